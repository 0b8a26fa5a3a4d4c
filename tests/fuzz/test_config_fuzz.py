"""Fuzzing ``launch.train --config``: whatever a recipe holds, the program answers within 5 s
and 512 MiB with exit status 2 and one line per problem (or 0 for a recipe that happens to
be valid), never a traceback.

Hypothesis drives the program's own ``main`` in this process (25 ms a recipe), seeded
(``derandomize``) so that ``make test`` tries the same recipes every run, over: truncations
and flipped bits of a shipped recipe (configs/smoke.yaml), trees of the schema's keys with
values of any type, alias bombs of any depth and width under any key, deep nesting, and
huge keys and values (up to past the reader's 1 MiB). One recipe goes through the real
program in a subprocess. ``FUZZ_EXAMPLES`` sets the number of recipes (``make test``: the
default below).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from launch.train import main
from trainer.config import Config
from trainer.yaml_file import MAX_BYTES

ROOT = Path(__file__).resolve().parents[2]
SMOKE = (ROOT / "configs" / "smoke.yaml").read_bytes()
SECONDS, MIB = 5.0, 512
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
LINES = 32  # the problems a config error lists (trainer.config.MAX_LINES) and its header


def _keys(model: type[BaseModel]) -> list[str]:
    """Every key name of the schema's sections (the words a recipe is made of)."""
    out = []
    for name, field in model.model_fields.items():
        out.append(name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _keys(ann)
    return out


KEYS = sorted(set(_keys(Config)) | {"base", "type", "dirs", "bins", "m", "s"})
SCALARS = (st.none() | st.booleans() | st.integers() | st.floats()
           | st.text(max_size=40) | st.sampled_from(KEYS))
TREES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner,
                                       max_size=4), max_leaves=24)


def _dumped(tree: dict) -> bytes:
    return yaml.safe_dump(tree, allow_unicode=True).encode()


def _bomb(levels: int, width: int, under: str) -> bytes:
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return ("\n".join(lines) + "\n" + under.replace("ALIAS", f"*l{levels - 1}") + "\n").encode()


def _flipped(data: bytes, spots: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for at, bit in spots:
        out[at % len(out)] ^= 1 << bit
    return bytes(out)


RECIPES = st.one_of(
    st.integers(0, len(SMOKE)).map(lambda n: SMOKE[:n]),
    st.lists(st.tuples(st.integers(0, len(SMOKE)), st.integers(0, 7)), min_size=1,
             max_size=4).map(lambda spots: _flipped(SMOKE, spots)),
    st.tuples(st.integers(0, len(SMOKE)), st.binary(max_size=16)).map(
        lambda t: SMOKE[:t[0]] + t[1] + SMOKE[t[0]:]),
    st.dictionaries(st.sampled_from(KEYS), TREES, max_size=6).map(_dumped),
    st.builds(_bomb, st.integers(1, 12), st.integers(1, 12),
              st.sampled_from(["data: {dirs: ALIAS}", "margin: ALIAS", "name: ALIAS",
                               "eval: {bins: ALIAS}", "z: ALIAS", "data: {ALIAS: 1}"])),
    st.builds(lambda depth, open_, close: (b"data: {dirs: " + open_ * depth + close * depth
                                           + b"}\n"),
              st.integers(1, 3000), st.just(b"["), st.just(b"]")),
    st.integers(1, 3000).map(lambda depth: b"a: " + b"{b: " * depth + b"1" + b"}" * depth),
    st.builds(lambda size, head: head + b"x" * size + b"\n",
              st.sampled_from([0, 1000, 100_000, MAX_BYTES - 20, MAX_BYTES + 10]),
              st.sampled_from([b"name: ", b"data:\n  dir: ", b"margin:\n  type: ", b"",
                               b"data: {dirs: [", b"base: "])),
)


def _rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())[1])


def _answer(recipe: Path) -> tuple[int, str, float, int]:
    """``launch.train --config recipe --check`` in this process: status, stderr, seconds, and
    the growth of the process's peak resident memory in KiB (the kernel's high-water mark,
    reset before the call through /proc/self/clear_refs: no cost, unlike tracemalloc, which
    made PyYAML 10 times slower)."""
    err = io.StringIO()
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss_kib("VmRSS")
    start = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["--config", str(recipe), "--check", "--errors-only"])
    took = time.perf_counter() - start
    return code, err.getvalue(), took, _rss_kib("VmHWM") - before


def _assert_bounded(code: int, err: str) -> None:
    lines = err.splitlines()
    assert "Traceback" not in err
    assert code == 0 and not lines or code == 2 and 1 <= len(lines) <= LINES + 1, err[:2000]
    if code == 2:
        assert lines[0] == "config error:" or lines[0].startswith("launch error: "), err[:2000]
        assert max(map(len, lines)) <= 2000, err[:2000]


# No shrinking: a failing recipe is shown as found (shrinking one took 5 minutes).
@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.large_base_example])
@given(text=RECIPES)
def test_any_recipe_gets_a_bounded_answer(text):
    with tempfile.TemporaryDirectory() as folder:
        here = os.getcwd()
        os.chdir(folder)  # a relative data.dir or output names nothing of the repository
        recipe = Path(folder) / "recipe.yaml"
        recipe.write_bytes(text)
        try:
            code, err, took, grown = _answer(recipe)
        finally:
            os.chdir(here)
    _assert_bounded(code, err)
    assert took < SECONDS and grown < MIB << 10, (took, grown >> 10, err[:500])


def test_a_broken_recipe_through_the_real_program(tmp_path):
    """The subprocess path, as ``make train`` runs it: a flipped bit and a truncation."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(_flipped(SMOKE, [(len(SMOKE) // 2, 5)])[: len(SMOKE) * 3 // 4])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "launch.train", "--config", str(recipe),
                           "--check"], capture_output=True, text=True, timeout=60, env=env,
                          cwd=tmp_path)
    _assert_bounded(proc.returncode, proc.stderr)
    assert proc.returncode == 2
