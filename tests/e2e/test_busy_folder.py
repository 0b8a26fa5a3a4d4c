"""A second job on a run folder another job holds: refused by the check before torchrun
starts (``make train``). Launched past the check, the ranks refuse it without writing a line
into the holder's train.log: ``test_launch_errors.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.test_make_train_args import _make_train
from tests.launch_helpers import ROOT

HOLDER = "import sys, time; from trainer.run_lock import RunLock; " \
         "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(300)"


@pytest.fixture
def held(tmp_path):
    """A run folder whose lock another live process holds, its train.log one line long."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("step 5/124 the running job's line\n")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield run
    proc.kill()
    proc.wait()


def test_make_train_is_refused_before_torchrun(held, synthetic_data):
    out = _make_train(synthetic_data, f"ARGS=output={held}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"launch error: {held} is in use by another job (pid " in out.stderr
    assert "torchrun" not in out.stdout + out.stderr  # the recipe stopped at the check
    assert (held / "train.log").read_text() == "step 5/124 the running job's line\n"

