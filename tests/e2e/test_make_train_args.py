"""``make train`` as a user extends it: ``data.dirs`` instead of the synthetic folder, another
recipe with ``CONFIG=``, and launch.train's options and overrides in any order."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.launch_helpers import ROOT


def _make_train(data, *variables: str) -> subprocess.CompletedProcess:
    """``make train`` on this interpreter (no venv set-up), the synthetic folder ``data``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["make", "--no-print-directory", "train", f"PY={sys.executable}",
                           "SETUP=", f"SMOKE_DATA={data}", *variables], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_data_dirs_and_options_after_overrides_pass_through_make(tmp_path, synthetic_data):
    """``--check`` after the overrides, ``data.dirs`` replacing the folder make would add: the
    check and the two torchrun ranks each validate and exit 0 without training."""
    out = _make_train(synthetic_data, f"ARGS=output={tmp_path / 'run'} "
                      f"data.dirs=[{synthetic_data},{synthetic_data}] --check")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "give data.dir or data.dirs" not in out.stderr
    assert not (tmp_path / "run").exists()  # checked, nothing started


def test_config_and_a_second_config_option(tmp_path, synthetic_data):
    """``CONFIG=`` picks the recipe; ``ARGS="--config X output=..."`` also works (the last
    --config wins)."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"base: {ROOT / 'configs' / 'smoke.yaml'}\nname: mine\n"
                      "train:\n  batch_size: 0\n")
    for variables in ([f"CONFIG={recipe}", "ARGS=--check"],
                      [f"ARGS=--config {recipe} output={tmp_path / 'run'} --check"]):
        out = _make_train(synthetic_data, *variables)
        assert out.returncode == 2 and f"{recipe.name}: train.batch_size=0" in out.stderr, \
            out.stderr[-2000:]
