"""Fuzzing ``launch.train --config``: whatever a recipe holds, the program answers within
the bounds of tests/fuzz/bounds.py with exit status 2 and one line per problem (at most
``trainer.config.MAX_LINES`` and a count of the rest), or 0 for a recipe that happens to be
valid; never a traceback.

Hypothesis drives the program's own ``main`` in this process (~25 ms a recipe), seeded, over:
damaged copies of a shipped recipe (configs/smoke.yaml: truncations, flipped bits, bytes
written over), trees of the schema's keys with values of any type, alias bombs of any depth
and width under any key, nesting thousands deep, and huge keys and values (up to past the
YAML reader's 1 MiB). One damaged recipe goes through the real program in a subprocess.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from launch.train import main
from tests.fuzz.bounds import MESSAGE_CHARS, damaged, figures, fuzz_settings, run_main, run_program
from trainer.config import MAX_LINES, Config
from trainer.yaml_file import MAX_BYTES

ROOT = Path(__file__).resolve().parents[2]
SMOKE = (ROOT / "configs" / "smoke.yaml").read_bytes()


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


RECIPES = st.one_of(
    damaged(SMOKE),
    st.tuples(st.integers(0, len(SMOKE)), st.binary(max_size=16)).map(
        lambda t: SMOKE[:t[0]] + t[1] + SMOKE[t[0]:]),
    st.dictionaries(st.sampled_from(KEYS), TREES, max_size=6).map(_dumped),
    st.builds(_bomb, st.integers(1, 12), st.integers(1, 12),
              st.sampled_from(["data: {dirs: ALIAS}", "margin: ALIAS", "name: ALIAS",
                               "eval: {bins: ALIAS}", "z: ALIAS", "data: {ALIAS: 1}"])),
    st.integers(1, 3000).map(lambda depth: b"data: {dirs: " + b"[" * depth + b"]" * depth
                             + b"}\n"),
    st.integers(1, 3000).map(lambda depth: b"a: " + b"{b: " * depth + b"1" + b"}" * depth),
    st.builds(lambda size, head: head + b"x" * size + b"\n",
              st.sampled_from([0, 1000, 100_000, MAX_BYTES - 20, MAX_BYTES + 10]),
              st.sampled_from([b"name: ", b"data:\n  dir: ", b"margin:\n  type: ", b"",
                               b"data: {dirs: [", b"base: "])),
)


def _assert_bounded(status: int, err: str) -> str:
    """The outcome of a recipe's answer, after checking it is a bounded one."""
    lines = err.splitlines()
    assert "Traceback" not in err, err[-MESSAGE_CHARS:]
    if status == 0:
        return "accepted"
    assert status == 2 and 1 <= len(lines) <= MAX_LINES + 2, (status, err[:MESSAGE_CHARS])
    assert lines[0] == "config error:" or lines[0].startswith("launch error: "), lines[0]
    assert max(map(len, lines)) < MESSAGE_CHARS, err[:MESSAGE_CHARS]
    return "refused"


@pytest.fixture(scope="module")
def config_figures():
    with figures("config: launch.train --config (YAML)") as tracked:
        yield tracked


@fuzz_settings(examples=150)
@given(text=RECIPES)
def test_any_recipe_gets_a_bounded_answer(config_figures, text):
    with tempfile.TemporaryDirectory() as folder:
        here = os.getcwd()
        os.chdir(folder)  # a relative data.dir or output names nothing of the repository
        try:
            Path("recipe.yaml").write_bytes(text)
            ran, error = config_figures.measure(lambda: run_main(
                main, ["--config", "recipe.yaml", "--check", "--errors-only"]))
        finally:
            os.chdir(here)
    if error is not None:
        raise error
    config_figures.count(_assert_bounded(ran.status, ran.err))


def test_a_damaged_recipe_through_the_real_program(tmp_path):
    """The subprocess path, as ``make train`` runs it: a flipped bit, then a truncation."""
    damaged_smoke = bytearray(SMOKE)
    damaged_smoke[len(SMOKE) // 2] ^= 1 << 5
    (tmp_path / "recipe.yaml").write_bytes(bytes(damaged_smoke[: len(SMOKE) * 3 // 4]))
    ran = run_program("launch.train", "--config", "recipe.yaml", "--check", cwd=str(tmp_path))
    assert _assert_bounded(ran.status, ran.err) == "refused"
