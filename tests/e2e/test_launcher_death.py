"""Ranks die with their launcher: ``kill -9`` of ``python -m launch.torchrun`` (as the OOM
killer takes a node agent) leaves a checkpoint at a step boundary, and no rank or loader
worker of the job outlives the launcher by more than ``dist.timeout_s`` + 30 s."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from tools.testbed import harness as chaos

pytestmark = pytest.mark.slow

TIMEOUT_S = 15  # dist.timeout_s of the run


# The ranks' watch of their launcher is the engines' alike, and DeepSpeed's save and resume
# are make test's in tests/trainer/test_checkpoint.py: the deepspeed row is make test-long's.
@pytest.mark.parametrize("engine", ["ddp", pytest.param("deepspeed", marks=pytest.mark.long)])
def test_ranks_save_and_end_when_the_launcher_is_killed(tmp_path, engine):
    data, run = chaos.write_data(tmp_path / "data"), tmp_path / "run"
    cmd = [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc_per_node", "2",
           "-m", "launch.train", "--config", str(chaos.SMOKE), f"data.dir={data}",
           f"output={run}", *chaos.BASE_ARGS, "train.max_steps=null", "train.epochs=100",
           "checkpoint.every=0", "data.num_workers=1", f"dist.timeout_s={TIMEOUT_S}",
           f"engine.type={engine}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(chaos.ROOT)}
    with open(tmp_path / "out.txt", "w") as out:  # not a pipe: the ranks outlive the reader
        proc = subprocess.Popen(cmd, cwd=chaos.ROOT, env=env, stdout=out, stderr=out,
                                start_new_session=True)
    job: list[int] = []
    try:
        chaos.wait_for_step(run, 2, proc)
        job = chaos.job_pids(proc.pid)[1:]  # the ranks and their loader workers
        assert len(job) >= 4, job  # 2 ranks, a worker each
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        chaos.wait_until(lambda: not any(map(chaos.running, job)), TIMEOUT_S + 30, every=0.5)
        survivors = [pid for pid in job if chaos.running(pid)]
    finally:  # whatever the outcome, nothing of the job stays
        for pid in [*job, *chaos.job_pids(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    said = (tmp_path / "out.txt").read_text()
    assert not survivors, said[-3000:]
    latest = (run / "checkpoints" / "latest").read_text().strip()
    log = (run / "train.log").read_text()
    assert f"stopped by the launcher's death (pid {proc.pid}) after step {int(latest[5:])}: " \
           f"checkpoint {run / 'checkpoints' / latest}" in log, log[-3000:]
    assert int(latest[5:]) >= 2
    assert not (run / ".lock").read_text()  # the lock released: the next job starts
