"""Preemption: SIGTERM or SIGUSR1 ends the run at the next step boundary with a checkpoint.

Cluster schedulers announce the end of a job with SIGTERM (SLURM: ``scancel``, a time limit
with ``--signal``; torchrun forwards its own SIGTERM to every worker) or a user signal, and
kill it a grace period later. The handler only records the signal; ``launch.train`` hands
``received`` to every step, whose one agreement all-reduce (``trainer.stopping``) takes the
largest request over the ranks, so that every rank stops after the same step even when the
signal reached only some of them (at no host read of its own), saves there and exits 0.
DataLoader workers ignore SIGUSR1 and their first SIGTERM (``data_pipeline.loader``), so a
signal sent to every process of the job (``scancel``) does not kill them before the trainer
has stopped; the trainer then ends them itself.
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Context manager: while active, SIGTERM/SIGUSR1 request a stop instead of killing."""

    def __init__(self):
        self.received = 0  # signal number, 0 = none
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _record(self, signum: int, frame) -> None:
        self.received = signum
