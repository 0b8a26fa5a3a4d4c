"""Preemption through the launcher the README gives (``make train``, ``python -m
launch.torchrun``): a real signal to every process of a 2-rank job with a loader worker, as
a scheduler delivers it, ends in a checkpoint, exit 0 from the launch and a resume at the
saved step; a rank killed for real still ends it non-zero."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tools.chaos import harness as chaos

pytestmark = pytest.mark.slow

ARGS = [*chaos.BASE_ARGS, "data.num_workers=1", "train.max_steps=40", "checkpoint.every=0",
        "log.wandb=disabled"]


def _launcher(data: Path, run: Path, engine: str) -> list[str]:
    return [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc_per_node", "2",
            "-m", "launch.train", "--config", str(chaos.SMOKE), f"data.dir={data}",
            f"output={run}", *ARGS, f"engine.type={engine}"]


def _make_train(data: Path, run: Path, engine: str) -> list[str]:
    return ["make", "--no-print-directory", "train", f"PY={sys.executable}", "SETUP=",
            f"SMOKE_DATA={data}", "ARGS=" + " ".join([f"output={run}", *ARGS,
                                                      f"engine.type={engine}"])]


def _start(cmd: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(chaos.ROOT),
           "WANDB_MODE": "disabled"}
    return subprocess.Popen(cmd, cwd=chaos.ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen) -> str:
    try:
        return proc.communicate(timeout=240)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()[0] + "\n(test: killed after 240 s)"


@pytest.mark.parametrize("engine, sig, command", [
    ("ddp", signal.SIGTERM, _launcher),
    ("deepspeed", signal.SIGUSR1, _make_train),
], ids=["ddp-SIGTERM-launcher", "deepspeed-SIGUSR1-make"])
def test_job_wide_signal_saves_exits_0_and_resumes(tmp_path, engine, sig, command):
    data, run = chaos.write_data(tmp_path / "data"), tmp_path / "run"
    proc = _start(command(data, run, engine))
    chaos.wait_for_step(run, 2, proc)
    chaos.signal_job(proc, sig)
    out = _finish(proc)
    name = signal.Signals(sig).name
    assert proc.returncode == 0, out[-3000:]
    stopped = re.search(rf"stopped by {name} after step (\d+)", out)
    assert stopped, out[-3000:]
    step = int(stopped.group(1))
    assert 2 <= step < 40
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{step:08d}"

    # The same command again, two steps further: resumed at the saved step.
    further = [a.replace("train.max_steps=40", f"train.max_steps={step + 2}")
               for a in command(data, run, engine)]
    proc = _start(further)
    out = _finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert f"at step {step}" in out and "resumed from" in out, out[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{step + 2:08d}"


def test_killed_rank_fails_the_launch(tmp_path):
    """SIGKILL to rank 1: no save explains it, the launcher exits non-zero."""
    data, run = chaos.write_data(tmp_path / "data"), tmp_path / "run"
    proc = _start(_launcher(data, run, "ddp"))
    chaos.wait_for_step(run, 2, proc)
    ranks = chaos.worker_pids(proc)
    assert 1 in ranks
    os.kill(ranks[1], signal.SIGKILL)
    out = _finish(proc)
    assert proc.returncode not in (0, None), out[-3000:]
