"""Stopping a run: signals, the launcher's death and a lost run-folder lock all end it at the
next step boundary with a checkpoint (the lock: without one), or at once when waiting would
take too long.

Cluster schedulers announce the end of a job with SIGTERM (SLURM: ``scancel``, a time limit
with ``--signal``; torchrun forwards its own SIGTERM to every worker) or a user signal, and
kill it a grace period later; Ctrl-C sends SIGINT. The handler only records the signal in
the run's :class:`trainer.stopping.StopRequests`, which the step reads at its one agreement
all-reduce, after its backward: the largest request over the ranks wins, so that every rank
stops after the same step, the one the signal came in, even when the signal reached only
some of them (at no host read of its own), saves there and exits 0. The handlers stay until
the run's end (its last checkpoint and summary): a signal that comes after the last step's
agreement has nothing left to stop, and must not kill one rank in the last save, which
would fail a finished job. DataLoader workers ignore SIGINT, SIGUSR1 and their first
SIGTERM (``data_pipeline.loader``), so a signal sent to every process of the job
(``scancel``, Ctrl-C) does not kill them before the trainer has stopped; the trainer then
ends them itself.

A signal does not wait for the step boundary when waiting cannot help: a second signal
(the user insists, or the grace period is running out; one within :data:`SAME_SIGNAL_S` of
the first is the same signal delivered twice), one arriving in the first step this
process runs (nothing new to save: the run resumes where it began), or one arriving while the
step, at the pace of the steps before it, has more than :data:`WAIT_FOR_STEP_S` left (a
CPU-sized step of minutes). The run then raises :class:`Interrupted` in the step: the last
checkpoint stays and the line says so.

The launcher's death comes as a signal too (:class:`LauncherWatch`), and the run lock's
heartbeat (``trainer.run_lock``) asks on its own thread: both into the same
:class:`trainer.stopping.StopRequests`, the run's one holder of stop requests, which
``launch.train`` makes and hands to the lock, these handlers and the loop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from data_pipeline.parent_death import die_with_parent
from trainer.errors import Stopped
from trainer.stopping import StopReason, StopRequests

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# PR_SET_PDEATHSIG's signal: the launcher died. Not SIGTERM: the kernel sends it when the
# launcher's forking thread exits, which under SIGKILL can come before the rank is reparented,
# so the parent pid cannot tell it from a scheduler's SIGTERM. No scheduler sends SIGUSR2.
LAUNCHER_SIGNAL = signal.SIGUSR2
WAIT_FOR_STEP_S = 30.0  # a stop signal waits this long at most for the step to end
# Signals this close to the first are the same one: a job-wide signal reaches a rank twice,
# from the scheduler (or the terminal's Ctrl-C) and forwarded by launch.torchrun.
SAME_SIGNAL_S = 2.0
LAUNCHER_POLL_S = 1.0
# Set by launch.torchrun (to MIN:MAX) for an elastic launch: a rank whose launcher dies ends
# at once, its node leaving as a lost machine does, and the other nodes go on without it.
ELASTIC_ENV = "PARTIAL_FC_ELASTIC"

class Interrupted(Stopped):
    """A stop signal the step's end could not wait for (a second one, or a long step)."""


class StopSignals:
    """Context manager around the step loop and the run's end: while active,
    SIGTERM/SIGUSR1/SIGINT request a stop (into ``stops``) instead of killing.
    ``progress()`` gives ``(steps done, time.monotonic() at the current step's start)``; it
    decides whether a signal may wait for the step's end. Once ``total`` steps are done the
    run is ending: a first signal then changes nothing."""

    def __init__(self, progress: Callable[[], tuple[int, float]] = lambda: (0, 0.0),
                 stops: StopRequests | None = None, total: int | None = None):
        self._signal = 0  # signal number, 0 = none
        self._signalled = 0.0  # time.monotonic() when it came
        self._progress = progress
        self.stops = StopRequests() if stops is None else stops
        self._total = total
        self._entered: tuple[int, float] = (0, 0.0)
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        self._entered = (self._progress()[0], time.monotonic())
        for sig in (*SIGNALS, LAUNCHER_SIGNAL):
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _record(self, signum: int, frame) -> None:
        launcher_gone = signum == LAUNCHER_SIGNAL
        name = "the launcher's death" if launcher_gone else signal.Signals(signum).name
        steps, started = self._progress()
        first_steps, entered = self._entered
        done_here = steps - first_steps
        now = time.monotonic()
        if self._signal and not launcher_gone and now - self._signalled < SAME_SIGNAL_S:
            return  # one job-wide signal reaching the rank twice (directly and forwarded)
        ended = self._total is not None and steps >= self._total
        if self._signal and not launcher_gone:
            why = f"a second stop signal ({name})"
        elif ended and not launcher_gone:  # the last save and summary are the stop's own
            self._signal, self._signalled = signum, now
            return
        elif done_here == 0:
            why = f"{name} in the first step this process runs (nothing new to save)"
        elif started + (started - entered) / done_here - now > WAIT_FOR_STEP_S:
            left = started + (started - entered) / done_here - now
            why = (f"{name} about {left:.0f} s before the step's end (more than "
                   f"{WAIT_FOR_STEP_S:.0f} s to wait)")
        elif launcher_gone:
            LAUNCHER_WATCH.report(self.stops)
            return
        else:
            self._signal, self._signalled = signum, now
            self.stops.signal(signum)
            return
        where, cut = ((f"after step {steps}, the last", "the run's end (its last checkpoint, "
                       "evaluation, summary) is cut short") if ended else
                      (f"step {steps + 1}", "the step in progress cannot be saved"))
        raise Interrupted(f"{where}: interrupted by {why}; {cut}, the last checkpoint stays: "
                          "run the same command again to resume from it")


class LauncherWatch:
    """A rank that outlives its launcher stops: the kernel sends it :data:`LAUNCHER_SIGNAL`
    when its parent dies (``PR_SET_PDEATHSIG``; a thread watching the parent pid sends it
    where the kernel cannot), which :class:`StopSignals` turns into ``StopReason.LAUNCHER_GONE``
    (a checkpoint at the next step boundary, or at once by the rules of any signal) and which
    ends the process outside the step loop. Should the rank still run ``grace_s`` after the
    death (its group broken, a collective stuck until ``dist.timeout_s``), the thread ends
    the process.

    In an elastic launch (:data:`ELASTIC_ENV`) the signal is SIGKILL instead: a stop at the
    next step would stop every node, where the launchers that live should restart the group
    without this node; its end fails their next collective and they do, from the last
    checkpoint (launch.rendezvous)."""

    def __init__(self):
        self.parent = 0  # the launcher's pid, 0 while not watching
        self.grace_s = 0.0
        self.reported = False  # the death is in a run's stop requests (no second signal)
        self.signal = LAUNCHER_SIGNAL  # what the death sends this process

    def start(self, grace_s: float) -> bool:
        """Watch this process's parent when a launcher started it (torchrun exports
        ``TORCHELASTIC_RUN_ID``); returns whether it watches. ``grace_s``: how long the rank
        may outlive the launcher."""
        self.grace_s = grace_s
        if self.parent or "TORCHELASTIC_RUN_ID" not in os.environ:
            return bool(self.parent)
        self.parent = os.getppid()
        if os.environ.get(ELASTIC_ENV):
            self.signal = signal.SIGKILL
        die_with_parent(self.signal)  # not Linux: the thread alone
        threading.Thread(target=self._watch, name="launcher-watch", daemon=True).start()
        return True

    def gone(self) -> bool:
        return bool(self.parent) and os.getppid() != self.parent

    def report(self, stops: StopRequests) -> None:
        """The launcher's death into the run's stop requests (from the signal handler)."""
        stops.request(StopReason.LAUNCHER_GONE, f"the launcher's death (pid {self.parent})")
        self.reported = True

    def _watch(self) -> None:
        """The parent's death as PR_SET_PDEATHSIG signals it, also where that signal cannot
        come (it died before the prctl, not Linux); then the bound on this rank's life."""
        while not self.gone():
            time.sleep(LAUNCHER_POLL_S)
        if not self.reported:  # else the run has it: no signal in a save
            os.kill(os.getpid(), self.signal)
        time.sleep(self.grace_s)
        with contextlib.suppress(OSError, ValueError):
            print(f"error: the launcher (pid {self.parent}) died {self.grace_s:.0f} s ago and "
                  f"this rank (pid {os.getpid()}) has not stopped; ending it", file=sys.stderr,
                  flush=True)
        os._exit(1)


LAUNCHER_WATCH = LauncherWatch()  # one per process: the process has one parent
