"""``make chaos`` rows that signal a rank: SIGTERM to one rank or to the whole job in step 5,
and a rank stopped (SIGSTOP, or stopping itself in its backward) until its peers' collective
times out (listed in ``tools/chaos/cases.py``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tools.testbed.harness import (
    STEPS,
    signal_job,
    train,
    wait_for_step,
    wait_until,
    while_held,
    worker_pids,
)


def sigterm_one_rank(data: Path, work: Path) -> tuple[str, bool]:
    """SIGTERM to rank 1 alone, in step 5 of 6 (the rank held there while the signal comes):
    both ranks save after step 5 and rank 0 says where to resume, once."""
    return _sigterm_in_step_5(data, work, lambda proc, pid: os.kill(pid, signal.SIGTERM))


def sigterm_whole_job(data: Path, work: Path) -> tuple[str, bool]:
    """SIGTERM to every process of the job (the launcher, both trainers, their loader
    workers), each by pid, as a scheduler does, in step 5 of 6: the trainers save after it,
    the launch exits 0 (``launch.torchrun``), and the resume equals an uninterrupted run."""
    return _sigterm_in_step_5(data, work, lambda proc, pid: signal_job(proc, signal.SIGTERM),
                              "data.num_workers=1")


def _sigterm_in_step_5(data: Path, work: Path, send: Callable[[subprocess.Popen, int], None],
                       *args: str) -> tuple[str, bool]:
    """A 2-rank run of :data:`STEPS` (6) steps whose rank 1 is held in step 5 while
    ``send(proc, rank 1's pid)`` signals; then its resume, against an uninterrupted run.

    The moment is the run's, not the machine's pace. These rows used to signal once step 2
    was logged, which on an idle machine could land in step 5: the stop then waited for the
    next step's agreement, step 6, the last, and the run simply finished (rc 0, no line).
    A signal now stops the run after the step it came in; step 5 is the last one where a
    stop leaves a step to resume."""
    whole = train(data, work / "whole", "checkpoint.every=0", *args, ranks=2)
    hold = work / "hold"
    split = train(data, work / "split", "checkpoint.every=0", *args, ranks=2,
                  inject=["hold-rank1-step5"], hold=hold,
                  until=lambda proc: while_held(hold, proc, lambda pid: send(proc, pid)))
    stopped = split.latest()
    told = split.out.count("stopped by SIGTERM after step 5: ") == 1 and "to resume" in split.out
    resumed = train(data, work / "split", "checkpoint.every=0", *args, ranks=2)
    same = _same_backbone(whole.run, resumed.run, STEPS)
    holds = split.rc == 0 and told and stopped == "step-00000005" and resumed.rc == 0 and same
    return f"launch rc {split.rc}, saved {stopped}, said where to resume once: {told}; " \
           f"resumed rc {resumed.rc}, final weights equal an uninterrupted run: {same}", holds


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)


def _end_once_reported(run: Path, pid: int, limit: float = 25) -> None:
    """Kill ``pid`` once rank 0's timeout report is in ``run/train.log`` (or after ``limit``
    seconds): the report is what the case checks, and waiting longer only waits."""
    log = run / "train.log"
    wait_until(lambda: log.is_file()
               and "timeout (dist.timeout_s=" in log.read_text(errors="replace"), limit)
    _kill_quietly(pid)


def _state(pid: int) -> str:
    """The one-letter state of ``pid`` (``T``: stopped), from /proc; ``?`` once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "?"


def stopped_rank(data: Path, work: Path, engine: str = "ddp",
                 in_backward: bool = False) -> tuple[str, bool]:
    """Rank 1 stopped (SIGSTOP from outside after step 2, or ``in_backward``: it stops itself
    in step 3's backward, leaving rank 0 in the data-parallel gradient reduction)."""
    stopped: list[tuple[int, float]] = []

    def stop_rank1(proc: subprocess.Popen) -> None:
        wait_for_step(work / "run", 2, proc)
        pids = worker_pids(proc)
        if 1 not in pids:
            return
        if not in_backward:
            os.kill(pids[1], 19)  # SIGSTOP: alive, silent, holding its peers in a collective
        wait_until(lambda: _state(pids[1]) == "T", 60, proc, every=0.05)
        stopped.append((pids[1], time.monotonic()))
        # Rank 0 reports after the 10 s timeout; then end the stopped rank rather than
        # wait out torchrun's 30 s SIGTERM grace (a stopped process defers SIGTERM).
        threading.Thread(target=_end_once_reported, args=(work / "run", pids[1]),
                         daemon=True).start()

    inject = ["stop-rank1-in-backward-3"] if in_backward else None
    r = train(data, work / "run", f"engine.type={engine}", "train.max_steps=50",
              "dist.timeout_s=10", ranks=2, until=stop_rank1, inject=inject)
    for pid, _ in stopped:
        _kill_quietly(pid)
    lines = [line for line in r.out.splitlines() if line.startswith("error on rank 0: step")]
    named = len(lines) == 1 and "a collective failed after 1" in lines[0] \
        and "timeout (dist.timeout_s=10)" in lines[0] and "resume from" in lines[0]
    if in_backward:
        named = named and lines[0].startswith("error on rank 0: step 3:") \
            and "step-00000002" in lines[0]
    return f"rc {r.rc}, {lines[0][:130] if lines else r.out[-300:]}", \
        bool(stopped) and r.rc != 0 and named


def _same_backbone(a: Path, b: Path, step: int) -> bool:
    import torch

    tag = f"step-{step:08d}"
    files = [p / "checkpoints" / tag / "backbone.pt" for p in (a, b)]
    if not all(f.is_file() for f in files):
        return False
    x, y = (torch.load(f, weights_only=True) for f in files)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x if "running" not in k)
