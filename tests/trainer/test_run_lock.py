"""One job per run folder (trainer.run_lock): the same command started twice, a takeover after
``kill -9``, two "nodes" (processes with different host names) on one folder, with and
without working fcntl locks, and a lease taken over under a running job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from launch_helpers import ROOT

from tools.testbed import harness as chaos
from trainer import run_lock
from trainer.run_lock import RunFolderInUse, RunLock
from trainer.stopping import StopReason, StopRequests

HOLDER = """
import sys, time
from trainer.run_lock import RunLock
lock = RunLock(sys.argv[1], host=sys.argv[2], fcntl_locks=sys.argv[3] == "1")
assert lock.acquire() is None
print("holding", flush=True)
time.sleep(120)
"""


def _holder(run, host: str, fcntl_locks: bool = True) -> subprocess.Popen:
    """Another process (on "node" ``host``) that takes ``run``'s lock and keeps it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), host,
                             "1" if fcntl_locks else "0"], env={**os.environ,
                            "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


@pytest.mark.parametrize("fcntl_locks", [True, False], ids=["fcntl", "lease-only"])
def test_a_second_node_is_refused_while_the_first_holds_the_folder(tmp_path, fcntl_locks):
    holder = _holder(tmp_path / "run", "node-a", fcntl_locks)
    try:
        with pytest.raises(RunFolderInUse) as err:
            RunLock(tmp_path / "run", host="node-b", fcntl_locks=fcntl_locks).acquire()
    finally:
        holder.kill()
        holder.wait()
    assert str(err.value).startswith(f"{tmp_path / 'run'} is in use by another job (pid "
                                     f"{holder.pid} on node-a, since 20")
    assert str(err.value).endswith("UTC): wait for it to end, or give this run its own folder "
                                   "(output=...)")


def test_a_dead_holders_lock_is_taken_over_with_one_line(tmp_path):
    holder = _holder(tmp_path / "run", "node-a")
    holder.send_signal(signal.SIGKILL)  # no clean release: the lease stays in the file
    holder.wait()
    lock = RunLock(tmp_path / "run", host="node-a")
    line = lock.acquire()
    try:
        assert line.startswith(f"run lock: took over {tmp_path / 'run' / '.lock'} from pid "
                               f"{holder.pid} on node-a, since ")
        assert line.endswith("s ago): that job is gone")
        assert json.loads((tmp_path / "run" / ".lock").read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert (tmp_path / "run" / ".lock").read_text() == ""  # a clean end: nothing to take over
    assert RunLock(tmp_path / "run").acquire() is None


def test_a_stale_lease_from_another_node_is_taken_over_a_fresh_one_refused(tmp_path):
    """Without fcntl locks the heartbeat decides: a node silent for STALE_S is gone."""
    path = tmp_path / ".lock"
    now = time.time()
    lease = {"host": "node-a", "pid": 1, "started": now - 500, "heartbeat": now - 5}
    path.write_text(json.dumps(lease))
    with pytest.raises(RunFolderInUse, match="pid 1 on node-a"):
        RunLock(tmp_path, host="node-b", fcntl_locks=False).acquire()
    path.write_text(json.dumps({**lease, "heartbeat": now - run_lock.STALE_S - 1}))
    lock = RunLock(tmp_path, host="node-b", fcntl_locks=False)
    assert "from pid 1 on node-a" in lock.acquire()
    lock.release()


def test_a_job_whose_lease_was_taken_over_asks_to_stop_without_a_checkpoint(tmp_path):
    stops = StopRequests()  # the run's, handed to its lock
    lock = RunLock(tmp_path, host="node-a", stops=stops)
    lock.acquire()
    try:
        assert lock.beat()  # its own lease: renewed
        now = time.time()
        (tmp_path / ".lock").write_text(json.dumps(
            {"host": "node-b", "pid": 9, "started": now, "heartbeat": now}))
        assert not lock.beat()
        reason, why = stops.current().reason, stops.detail
        assert reason is StopReason.LOCK_LOST
        assert why.startswith(f"{tmp_path} was taken over by another job (pid 9 on node-b, "
                              "since ")
    finally:
        lock.release()
    assert json.loads((tmp_path / ".lock").read_text())["host"] == "node-b"  # theirs, kept


@pytest.mark.slow
def test_the_same_command_twice_refuses_the_second_before_any_step(tmp_path):
    """``launch.train`` started again on a running job's folder: one line naming the first
    job, exit 2, and the first job's metrics and checkpoints untouched."""
    data, run = chaos.write_data(tmp_path / "data"), tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "launch.train", "--config", str(chaos.SMOKE),
           f"data.dir={data}", f"output={run}", *chaos.BASE_ARGS, "train.max_steps=null",
           "train.epochs=100"]
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        chaos.wait_for_step(run, 1, first)
        second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=120)
        steps = (run / "metrics.jsonl").read_text().count('"step"')
        time.sleep(1)
        assert first.poll() is None  # still training, its files growing
        assert (run / "metrics.jsonl").read_text().count('"step"') >= steps
    finally:
        first.kill()
        first.wait()
    errors = [line for line in second.stderr.splitlines() if line.startswith("error")]
    assert second.returncode == 2, second.stderr
    assert len(errors) == 1 and errors[0].startswith(
        f"error: {run} is in use by another job (pid {first.pid} on {os.uname().nodename}, "
        "since "), second.stderr
    assert errors[0].endswith("wait for it to end, or give this run its own folder (output=...)")
    assert "Traceback" not in second.stderr and "resumed" not in second.stderr


def test_a_run_whose_lease_is_taken_over_stops_after_the_step_without_a_checkpoint(
        tmp_path, monkeypatch, capsys):
    """Another job's lease appears in RUN/.lock during step 3 (this one hung, was taken over
    and woke up): the heartbeat asks the run's stop requests, which step 3's agreement reads,
    so the run stops after step 3 (the step it came in, as a signal does) without a
    checkpoint, and nothing more is written to the folder that now belongs to the other
    job."""
    from launch_helpers import train_in_process

    from trainer.engine import Engine

    data, run = chaos.write_data(tmp_path / "data"), tmp_path / "run"
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.01)
    original = Engine.step

    def step_while_taken_over(self, index, micro_batches, **kwargs):
        if index == 2:
            now = time.time()
            (run / ".lock").write_text(json.dumps(
                {"host": "node-b", "pid": 9, "started": now, "heartbeat": now}))
            time.sleep(0.3)  # the heartbeat's turn
        return original(self, index, micro_batches, **kwargs)

    monkeypatch.setattr(Engine, "step", step_while_taken_over)
    assert train_in_process(data, run, "train.max_steps=6", "checkpoint.every=2") == 1
    err = capsys.readouterr().err
    assert f"error: step 3: {run} was taken over by another job (pid 9 on node-b, since " in err
    assert "this job stops without a checkpoint" in err
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    assert json.loads((run / ".lock").read_text())["host"] == "node-b"  # left to its owner


def test_a_run_on_a_dead_jobs_folder_says_it_took_the_lock_over(tmp_path, capsys):
    """The lease of a job that died (kill -9: no clean release) is in RUN/.lock: the next run
    says it takes over, in one line on the console and in train.log, and trains."""
    from launch_helpers import train_in_process

    data, run = chaos.write_data(tmp_path / "data"), tmp_path / "run"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    run.mkdir()
    (run / ".lock").write_text(json.dumps({"host": os.uname().nodename, "pid": int(dead),
                                           "started": 0.0, "heartbeat": 0.0}))
    assert train_in_process(data, run, "train.max_steps=1") == 0
    line = (f"run lock: took over {run / '.lock'} from pid {dead} on {os.uname().nodename}, "
            "since 1970-01-01 00:00:00 UTC")
    assert line in capsys.readouterr().err and line in (run / "train.log").read_text()
    assert (run / ".lock").read_text() == ""
