"""How a run's failure is told: a collective that failed, as the one line naming the phase the
run was in (:class:`CollectiveFailed`, :func:`collectives_of`), and the one report of any
failure after the process group started (:func:`report_failure`), whose ranks, words and
exit code are :func:`trainer.errors.classify`'s."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from trainer.errors import (
    Scope,
    Stopped,
    classify,
    collective_detail,
    is_collective_failure,
    yield_to_reporter,
)
from trainer.telemetry.console import append_log


class CollectiveFailed(Stopped, RuntimeError):
    """A collective timed out or lost a peer: another rank stopped, died or fell behind.
    Each rank that waited reports it (the others may be stopped or gone)."""

    scope = Scope.ONE_RANK


@contextlib.contextmanager
def collectives_of(phase: Callable[[], str], timeout_s: float,
                    resume_from: Callable[[], Path | None] = lambda: None,
                    since: Callable[[], float] | None = None) -> Iterator[None]:
    """Turn a failed collective inside the block into the one-line :class:`CollectiveFailed`
    (any other error passes through): ``phase()`` names where the run was ("step 12",
    "building the engine", ...), ``resume_from()`` the checkpoint a rerun resumes, and the
    wait is counted from ``since()`` (the block's start when None; a step's own start in
    the loop)."""
    started = time.monotonic()
    try:
        yield
    except RuntimeError as err:  # torch's DistError subclasses and gloo's plain RuntimeError
        if not is_collective_failure(err):
            raise
        waited = time.monotonic() - (started if since is None else since())
        raise CollectiveFailed(
            f"{phase()}: a collective failed after {waited:.0f} s ({collective_detail(err)}): "
            "another rank stopped, died or fell behind by more than the process group's "
            f"timeout (dist.timeout_s={timeout_s:g}); resume from {resume_from() or 'the start'}"
        ) from None


def report_failure(err: Exception, rank: int, run_dir: Path | None) -> int:
    """Print a failure after the process group started, and append it to ``run_dir``'s
    train.log (every rank that reports; None: the folder is not this job's); returns the
    exit code.

    Which ranks print, what and the exit code are the error's to say
    (:func:`trainer.errors.classify`): one line from rank 0 for an error every rank raises
    together (config, checkpoint, divergence), one line from the rank that met it for its
    data or a failed collective, and for anything else (a bug) the traceback from each rank.
    """
    report = classify(err, rank)
    if report.prints:
        print(report.text, end="" if report.text.endswith("\n") else "\n", file=sys.stderr,
              flush=True)
        if run_dir is not None:
            append_log(run_dir, report.logged)
    else:
        yield_to_reporter()
    return report.exit_code
