"""trainer.yaml_file: every YAML the project reads is bounded (size, aliases expanded, depth)
and a refusal is one line, from each path a user's file reaches: ``launch.train --check``
(what ``make train``/``make <recipe>`` run before torchrun), a training run (refused before
any process group), torchrun's look at the run folder, a resume from a run folder, and the
programs that read a run folder's config.yaml.

The bomb: nine levels of aliases, each a list of nine references to the one above, 400
bytes standing for 9^9 strings. Before the bounded reader it hung ``launch.train --check``
more than 60 s (a schema error's repr walked it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from launch_helpers import ROOT

from trainer.config import ConfigError, load_config, run_folder
from trainer.yaml_file import (
    MAX_BYTES,
    MAX_DEPTH,
    MAX_NODES,
    YamlRefused,
    parse_yaml,
    read_mapping,
    shown_value,
)


def bomb_text(levels: int = 9, width: int = 9, under: str = "data: {dirs: *%s}") -> str:
    """The billion-laughs recipe: ``levels`` anchors, each ``width`` aliases of the one before,
    the last one given as ``under`` says."""
    names = [f"l{i}" for i in range(levels)]
    lines = [f"{names[0]}: &{names[0]} [{', '.join(['lol'] * width)}]"]
    lines += [f"{names[i]}: &{names[i]} [{', '.join([f'*{names[i - 1]}'] * width)}]"
              for i in range(1, levels)]
    return "\n".join([*lines, under % names[-1]]) + "\n"


@pytest.fixture
def bomb(tmp_path) -> Path:
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb_text())
    return path


def _refused_in_a_second(call) -> str:
    start = time.perf_counter()
    with pytest.raises((ConfigError, YamlRefused)) as info:
        call()
    assert time.perf_counter() - start < 1.0
    return str(info.value)


def test_the_bomb_is_refused_in_one_line_within_a_second(bomb):
    msg = _refused_in_a_second(lambda: load_config(bomb))
    assert msg == (f"{bomb}: invalid YAML at line 5: more than {MAX_NODES} values once "
                   "aliases are expanded (a config holds a few hundred)")
    # torchrun's launcher reads the run folder from the recipe: no hang there either
    start = time.perf_counter()
    assert run_folder(bomb) is None and time.perf_counter() - start < 1.0


@pytest.mark.parametrize("check", [True, False], ids=["check", "training-run"])
def test_launch_train_refuses_the_bomb_before_any_process_group(bomb, capsys, check):
    from launch.train import main

    start = time.perf_counter()
    assert main(["--config", str(bomb), *["--check"] * check]) == 2
    assert time.perf_counter() - start < 1.0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "config error:" and len(err) == 2 and "more than" in err[1]
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_a_resume_from_a_run_folder_whose_config_is_the_bomb(tmp_path, capsys):
    """``--config RUN/config.yaml`` resumes a run; the programs reading a run folder's
    config.yaml (export, embed, evaluate, report, model card) refuse it in one line too."""
    from launch.report import ReportError, load_run
    from launch.train import main
    from offline.model_card import card_facts

    run = tmp_path / "run"
    (run / "checkpoints" / "step-4").mkdir(parents=True)
    (run / "config.yaml").write_text(bomb_text())
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert main(["--config", str(run / "config.yaml"), f"output={run}"]) == 2
    assert "more than" in capsys.readouterr().err
    for call, kind in [(lambda: load_run(str(run)), ReportError),
                       (lambda: card_facts(run / "config.yaml", run / "x", "mit"), YamlRefused)]:
        start = time.perf_counter()
        with pytest.raises(kind, match="more than"):
            call()
        assert time.perf_counter() - start < 1.0


def test_the_bomb_from_the_command_line_is_refused_in_a_second(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: x\n")
    value = "{" + bomb_text(under="z: *%s").replace("\n", ", ").rstrip(", ") + "}"
    msg = _refused_in_a_second(lambda: load_config(recipe, [f"data.dirs={value}"],
                                                   resolve=False))
    assert msg.startswith("command line: data.dirs='{l0: &l0 [lol, lol, lol, lol, lol, lol,")
    assert "more than" in msg and len(msg) < 400


def test_the_bomb_through_the_real_program(bomb):
    """One subprocess: ``python -m launch.train --check``, as ``make train`` runs it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "launch.train", "--config", str(bomb),
                           "--check"], capture_output=True, text=True, timeout=60, env=env)
    took = time.perf_counter() - start
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == ["config error:", f"{bomb}: invalid YAML at line 5: "
                                        f"more than {MAX_NODES} values once aliases are "
                                        "expanded (a config holds a few hundred)"]
    assert took < 30  # the interpreter and torch's import; the refusal itself is ms


@pytest.mark.parametrize(("text", "why"), [
    ("a: &a [1, *a]\n", "line 1: an alias inside its own anchor"),
    ("a: " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "\n",
     f"line 1: nested deeper than {MAX_DEPTH} levels"),
    ("a: [" + ", ".join(["1"] * MAX_NODES) + "]\n", f"line 1: more than {MAX_NODES} values"),
    ("a: 1\nb: 2\na: 3\n", "line 3: duplicate key 'a' (first set at line 1)"),
    ("? [1, 2]\n: 3\n", "line 1: a list as a key"),
    ("a: 2001-02-30\n", "invalid YAML value: day is out of range for month"),
    ("a: " + "9" * 5000 + "\n", "invalid YAML value: Exceeds the limit"),
    ("a: !!python/object:os.system x\n", "line 1: could not determine a constructor"),
    ("a: b\n---\nc: d\n", "line 2: but found another document"),
    (b"a: \xff\xfe\n", "unacceptable character #x00ff: invalid start byte"),
])
def test_each_malformed_or_unbounded_text_is_one_line(text, why):
    with pytest.raises(YamlRefused) as info:
        parse_yaml(text, "f.yaml")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("f.yaml: ") and why in msg and len(msg) < 300


def test_the_bounds_leave_room_for_any_config(tmp_path):
    """The largest tree and nesting the bounds allow load, aliases counted as what they
    repeat: 99 aliases of a 100-node list are 9,999 nodes; a recipe beside a 1 MiB file."""
    nested = parse_yaml("[" * MAX_DEPTH + "]" * MAX_DEPTH + "\n", "f")
    assert str(nested) == "[" * MAX_DEPTH + "]" * MAX_DEPTH
    text = "a: &a [" + ", ".join(["1"] * 99) + "]\nb: [" + ", ".join(["*a"] * 98) + "]\n"
    assert len(parse_yaml(text, "f")["b"]) == 98
    big = tmp_path / "big.yaml"
    big.write_bytes(b"a: 1\n" + b"#" * (MAX_BYTES - 6) + b"\n")
    assert read_mapping(big) == {"a": 1}
    big.write_bytes(b"a: 1\n" + b"#" * MAX_BYTES)
    with pytest.raises(YamlRefused,
                       match=r"big.yaml: 1048581 bytes, over the limit of 1048576 for a YAML"):
        read_mapping(big)


def test_every_yaml_reader_of_the_project_uses_the_bounded_one():
    """No module outside trainer/yaml_file.py parses YAML itself (tests read their own
    programs' output)."""
    calls = ("yaml.safe_load", "yaml.load(", "yaml.full_load", "yaml.unsafe_load",
             "yaml.compose", "yaml.load_all", "yaml.safe_load_all", "from yaml import")
    found = [f"{path.relative_to(ROOT)}: {call}"
             for folder in ("partial_fc", "data_pipeline", "trainer", "launch", "offline",
                            "tools", "bench", "scripts")
             for path in (ROOT / folder).rglob("*.py") if path.name != "yaml_file.py"
             for call in calls if call in path.read_text()]
    assert found == []


def test_a_value_a_message_quotes_is_cut():
    level: list = ["x" * 10**6] * 9
    for _ in range(8):
        level = [level] * 9  # 9^9 strings of 1 MB, shared
    assert len(shown_value(level)) <= 160 and len(shown_value("y" * 10**6)) <= 160


def test_a_recipe_of_many_wrong_values_lists_thirty(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({f"k{i}": i for i in range(500)}))
    lines = _refused_in_a_second(lambda: load_config(recipe, resolve=False)).splitlines()
    assert len(lines) == 31 and lines[-1] == "(470 more problems not shown)"
