"""torchrun --max-restarts: a killed rank restarts the job, which resumes from the last
checkpoint and ends where an uninterrupted run ends (2 gloo ranks, the smoke backbone)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from tools.testbed import harness as chaos

pytestmark = [pytest.mark.slow, pytest.mark.long]


def _torchrun(data, run, max_restarts: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", str(max_restarts), "-m", "launch.train", "--config",
           str(chaos.SMOKE), f"data.dir={data}", f"output={run}", *chaos.BASE_ARGS,
           "train.max_steps=8", "log.wandb=disabled", "dist.timeout_s=60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(chaos.ROOT)}
    return subprocess.Popen(cmd, cwd=chaos.ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _final_backbone(run) -> dict:
    return torch.load(run / "checkpoints" / "step-00000008" / "backbone.pt", weights_only=True)


def test_killed_rank_restarts_resumes_and_ends_equal(tmp_path):
    data = chaos.write_data(tmp_path / "data")
    whole = _torchrun(data, tmp_path / "whole", max_restarts=0)
    out_whole, _ = whole.communicate(timeout=400)
    assert whole.returncode == 0, out_whole[-3000:]

    run = tmp_path / "killed"
    proc = _torchrun(data, run, max_restarts=1)
    chaos.wait_for_step(run, 5, proc)  # checkpoints at 2 and 4 (chaos.BASE_ARGS)
    pids = chaos.worker_pids(proc)
    assert 1 in pids, "rank 1 not found"
    os.kill(pids[1], signal.SIGKILL)
    try:
        out, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the restarted job hung")
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in out, out[-3000:]
    expected, got = _final_backbone(tmp_path / "whole"), _final_backbone(run)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
