"""Why a run stops before its last step, and how a part of the trainer asks for it.

A stop is asked for on one rank (a signal reached it, its disk is full, its launcher or its
run folder's lock is gone) and must happen on every rank after the same step, or the ranks
that go on hang in the next collective. So a request only travels: :class:`StopRequests`
keeps this rank's, ``trainer.engine.Engine.step`` carries it in the step's one all-reduce
(the largest :class:`StopReason` wins, and the largest signal number), and the loop acts on
the agreed :class:`StopRequest` after that step, the same on every rank.
"""

from __future__ import annotations

import enum
import signal
import threading
from dataclasses import dataclass

from trainer.errors import Stopped


class StopReason(enum.IntEnum):
    """Why the run stops early; when ranks ask for different reasons, the largest wins."""

    NONE = 0
    SIGNAL = 1  # SIGTERM/SIGUSR1/SIGINT (a scheduler's notice): a checkpoint, then exit 0
    DISK_FULL = 2  # rank 0 could not write a run file: no checkpoint, the last one stays
    LAUNCHER_GONE = 3  # the launcher that started this rank died: a checkpoint, then exit
    LOCK_LOST = 4  # another job holds the run folder: write nothing more there

    @property
    def saves(self) -> bool:
        """Whether the run writes a checkpoint at the step it stops after."""
        return self in (StopReason.SIGNAL, StopReason.LAUNCHER_GONE)


@dataclass(frozen=True)
class StopRequest:
    """A stop request: ``reason`` and, for :attr:`StopReason.SIGNAL`, the signal's number."""

    reason: StopReason = StopReason.NONE
    signum: int = 0

    def __bool__(self) -> bool:
        return self.reason is not StopReason.NONE

    @property
    def signal_name(self) -> str:
        """``SIGTERM``, ``SIGUSR1``, ...; the reason's name when no signal was given."""
        if self.signum:
            return signal.Signals(self.signum).name
        return self.reason.name.lower().replace("_", " ")


NO_STOP = StopRequest()
"""The request of a rank that asks for nothing."""


class StopRequested(Stopped, RuntimeError):
    """The run stopped on every rank for a reason that writes no checkpoint (the run
    folder's lock is gone); the last checkpoint stays."""


class StopRequests:
    """This rank's stop requests until a step carries them: the public way for any part of
    the trainer (the signal handler, the logger, a launcher or lock watch) to stop the run.
    Only the largest reason is kept, with the ``detail`` its caller gave for the one line the
    run ends with. The run holds one (``trainer.run_state.Run.stops``, made by ``launch.train``)
    and hands it to every watcher: there is no other place a request can wait.

    The step reads :meth:`current` at its agreement, after its forward and backward, so a
    signal that came while the step ran stops the run after that step, not after the next
    one. The signal handler may run between any two lines of the training thread, this
    class's included: it only assigns :attr:`signum` (:meth:`signal`), which :meth:`current`
    reads once, so a request is never read half-written. Watcher threads (the run lock's
    heartbeat) call :meth:`request`: it replaces ``(reason, detail)`` as one value, under a
    lock the signal handler never takes.
    """

    def __init__(self):
        self._asked = (StopReason.NONE, "")  # (reason, detail), replaced whole
        self._lock = threading.Lock()
        self.signum = 0  # the stop signal received (StopReason.SIGNAL), 0 for none

    @property
    def reason(self) -> StopReason:
        return self._asked[0]

    @property
    def detail(self) -> str:
        return self._asked[1]

    def request(self, reason: StopReason, detail: str = "") -> None:
        """Ask every rank to stop after the next step, for ``reason`` (from any thread but
        a signal handler); ``detail`` says what happened (e.g. the file that could not be
        written). A request for a reason already asked for keeps the first detail."""
        with self._lock:
            if reason > self._asked[0]:
                self._asked = (reason, detail)

    def signal(self, signum: int) -> None:
        """A stop signal (its number) asks every rank to stop after the step now running:
        :attr:`StopReason.SIGNAL`. Called from the signal handler only."""
        self.signum = signum

    def current(self) -> StopRequest:
        """What this rank asks for now (``StopReason.NONE`` when nothing)."""
        signum = self.signum
        reason = max(self.reason, StopReason.SIGNAL) if signum else self.reason
        return StopRequest(reason, signum)
