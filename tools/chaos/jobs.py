"""``make chaos`` rows about the job as a whole: its launcher killed under its ranks, and a
second job started on a running job's folder (listed in ``tools/chaos/cases.py``; the pytest
twins are tests/e2e/test_launcher_death.py and tests/trainer/test_run_lock.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from tools.testbed.harness import Result, job_pids, running, train, wait_for_step, wait_until

TIMEOUT_S = 15  # dist.timeout_s of the runs here
LONG = ["train.max_steps=null", "train.epochs=100", "checkpoint.every=0"]


def launcher_killed(data: Path, work: Path) -> tuple[str, bool]:
    """SIGKILL to ``launch.torchrun`` at step 2: its ranks save at the next step boundary
    and, with their loader workers, are gone within ``dist.timeout_s`` + 30 s."""
    run, job, killed = work / "run", [], []

    def kill_launcher(proc) -> None:
        wait_for_step(run, 2, proc)
        job.extend(job_pids(proc.pid)[1:])
        os.kill(proc.pid, signal.SIGKILL)
        killed.append(time.monotonic())

    train(data, run, *LONG, "data.num_workers=1", f"dist.timeout_s={TIMEOUT_S}", ranks=2,
          until=kill_launcher)  # returns when the ranks close the output
    wait_until(lambda: not any(map(running, job)), killed[0] + TIMEOUT_S + 30 - time.monotonic(),
               every=0.5)
    survivors = [pid for pid in job if running(pid)]
    for pid in survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    log = (run / "train.log").read_text() if (run / "train.log").is_file() else ""
    latest = Result(0, "", run).latest()
    said = "stopped by the launcher's death" in log
    return (f"{len(job)} processes, survivors {len(survivors)}, latest {latest}, said so: "
            f"{said}"), not survivors and latest is not None and said


def second_job(data: Path, work: Path) -> tuple[str, bool]:
    """The same command started again while the first runs: refused in one line naming the
    first (pid, host, since when) before any step; the first goes on and saves on SIGTERM."""
    run, second, holder = work / "run", [], []

    def start_again(proc) -> None:
        wait_for_step(run, 1, proc)
        holder.append(proc.pid)  # one process: the trainer that holds the lock
        second.append(train(data, run, *LONG))
        proc.send_signal(signal.SIGTERM)

    first = train(data, run, *LONG, until=start_again)
    errors = second[0].errors() if second else []
    named = len(errors) == 1 and f"is in use by another job (pid {holder[0]} on " in errors[0] \
        and "output=" in errors[0]
    return (f"second rc {second[0].rc if second else None}: {errors[0][:90] if errors else '-'}"
            f"; first rc {first.rc}"), bool(second) and second[0].rc == 2 and named \
        and first.rc == 0 and "stopped by SIGTERM" in first.out
