"""User errors with exit codes, and the one report of any failure.

A failure a user can cause or must act on is a :class:`UserError`. Its class declares what
the program does with it: the exit code (``Refused``: 2, the input or config was refused
before anything ran; ``Stopped``: 1, the run stopped for a reason the user must act on) and
the :class:`Scope` (raised by every rank together, so rank 0 alone reports it, or met by one
rank alone, which reports it). The exception types stay where they are raised
(``trainer.config.ConfigError``, ``trainer.checkpoint.CheckpointError``, ...) and subclass
one of the two kinds here. :func:`classify` turns any exception into a :class:`Report`:
one line for a user error, a traceback for anything else (a bug).

Two kinds of foreign error are recognised here and nowhere else: ``data_pipeline``'s
``DataError`` (``data_pipeline`` cannot know these classes; :func:`foreign_kinds`) and a failed
collective (torch's types, and gloo's plain ``RuntimeError``: :func:`is_collective_failure`).
"""

from __future__ import annotations

import enum
import os
import re
import time
import traceback
from dataclasses import dataclass
from typing import ClassVar

import torch.distributed as dist

# Every program's --help ends with this (launch/*.py); docs/training.md says the same.
EXIT_STATUS = ("exit status: 0 done; 2 bad input, refused before anything ran (arguments, "
               "config, data folder, checkpoint path, a run folder in use); 1 a runtime "
               "failure (a stopped or interrupted run, a failed write, a bug)")


class Scope(enum.Enum):
    """Which ranks report an error; it follows from which ranks raise it."""

    ALL_RANKS = "all ranks"  # raised by every rank on the same step: rank 0 alone reports
    ONE_RANK = "one rank"  # met by one rank alone (its data, a lost peer): that rank reports


class UserError(Exception):
    """An error the user can cause or must act on: one line naming the file, key or value,
    never a traceback. Subclass :class:`Refused` or :class:`Stopped`, not this."""

    exit_code: ClassVar[int] = 1
    scope: ClassVar[Scope] = Scope.ALL_RANKS
    label: ClassVar[str] = "error"  # what the printed line starts with


class Refused(UserError):
    """The user's input (config, flags, a run folder) was refused before anything ran."""

    exit_code = 2


class Stopped(UserError):
    """The run stopped for a reason the user must act on (divergence, a full disk, a lost
    peer, bad data); the last checkpoint stays."""

    exit_code = 1


class BadData(Stopped):
    """``data_pipeline.errors.DataError`` as the trainer reports it: the rank whose shard or
    sample is at fault says so (:func:`foreign_kinds`)."""

    scope = Scope.ONE_RANK


def foreign_kinds() -> tuple[tuple[type[BaseException], type[UserError]], ...]:
    """Exceptions of the packages below ``trainer`` that are user errors, and their kind
    (imported here, not at the top: ``data_pipeline`` pulls in the loader's imports)."""
    from data_pipeline.errors import DataError

    return ((DataError, BadData),)


@dataclass(frozen=True)
class Report:
    """What one rank does about a failure: print ``text`` on stderr and append ``logged`` to
    train.log when ``prints``, then exit with ``exit_code``. ``kind`` is the
    :class:`UserError` class, None for a bug (``text`` is then its traceback, printed by
    every rank that hit it)."""

    kind: type[UserError] | None
    exit_code: int
    scope: Scope
    prints: bool
    text: str
    logged: str


def classify(err: BaseException, rank: int) -> Report:
    """The report of ``err`` on ``rank``. A user error is one line (several for a config
    error that lists several problems): ``<label>: <message>`` from rank 0 when all ranks
    raised it, ``<label> on rank <rank>: <message>`` from the rank that met it."""
    user = as_user_error(err)
    if user is None:
        text = "".join(traceback.format_exception(err))
        return Report(None, 1, Scope.ONE_RANK, True, text, f"rank {rank}: {text}")
    kind = type(user)
    where = f" on rank {rank}" if kind.scope is Scope.ONE_RANK else ""
    line = f"{kind.label}{where}: {user}"
    prints = kind.scope is Scope.ONE_RANK or rank == 0
    return Report(kind, kind.exit_code, kind.scope, prints, line, line)


# How long a rank that does not print a failure every rank met waits before it exits, and
# what torchrun and srun export to the processes they start.
REPORTER_HEAD_START_S = 15.0
LAUNCHER_ENV = frozenset({"TORCHELASTIC_RUN_ID", "SLURM_PROCID"})


def yield_to_reporter() -> None:
    """Wait before exiting on a failure that another rank reports, when a launcher started
    this process. A launcher (torchrun, srun) ends a job's other processes as soon as one
    exits with an error; the rank that prints must exit first, or its line is lost with it.
    The wait costs nothing when the reporter exits first: the launcher then ends this rank
    in its wait."""
    if LAUNCHER_ENV.intersection(os.environ):
        time.sleep(REPORTER_HEAD_START_S)


def as_user_error(err: BaseException) -> UserError | None:
    """``err`` itself, its :func:`foreign_kinds` kind, or None (a bug).

    torch's DataLoader re-raises an exception of a worker process as the same type with the
    worker's traceback in the message, whose last line is ``<module>.<Type>: <message>``; a
    foreign error keeps that last line's message only."""
    if isinstance(err, UserError):
        return err
    for foreign, kind in foreign_kinds():
        if isinstance(err, foreign):
            last = (str(err).strip().splitlines() or [""])[-1]
            return kind(last.removeprefix(f"{type(err).__module__}.{type(err).__name__}: "))
    return None


# gloo's transport puts its source location first: "[<path>/gloo/transport/tcp/pair.cc:553] "
_GLOO_TRANSPORT = re.compile(r"\[[^\]\n]*gloo/transport/[^\]\n]*\]")
# ... except on the other operations of a context one of whose receives timed out: gloo
# (transport/tcp/unbound_buffer.cc, UnboundBuffer::waitRecv) closes every pair with this text.
_GLOO_PAIRS_CLOSED = "Application timeout caused pair closure"
_SOURCE_LOCATION = re.compile(r"^\[[^\]\n]*\]\s*")


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is a failed collective: a peer that never joined within the process
    group's timeout, or one whose connection closed (it died or its node is gone).

    torch raises :class:`torch.distributed.DistError` subclasses for NCCL
    (``DistBackendError``) and the rendezvous store (``DistStoreError``,
    ``DistNetworkError``). gloo does not: its transport's errors are a C++
    ``gloo::IoException``, which reaches Python as a plain ``RuntimeError``. Measured on
    torch 2.13 with 2 CPU ranks and a 2-3 s timeout (all_reduce, broadcast, barrier,
    all_gather, all_gather_object, an async work's ``wait``, a ``new_group``, DDP's gradient
    reduction in backward, a collective inside an autograd backward, DeepSpeed's
    ``deepspeed.comm``), gloo says one of three things:

    - a peer that never joins: "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out
      waiting 3000ms for recv operation to complete";
    - a peer that exited or closed the group: "[.../gloo/transport/tcp/pair.cc:553]
      Connection closed by peer ...";
    - any other operation pending on the same gloo context when one receive timed out:
      exactly "Application timeout caused pair closure", without a location (what the
      trainer met in a checkpoint's ``all_gather_object`` with a stopped peer).

    Lacking a type, a plain ``RuntimeError`` (exactly that type) counts when its message
    starts with a source location under ``gloo/transport/`` or is that fixed sentence;
    gloo's other checks (e.g. a size mismatch, located elsewhere) stay bugs.
    """
    if isinstance(err, dist.DistError):
        return True
    if type(err) is not RuntimeError:
        return False
    message = str(err).strip()
    return message == _GLOO_PAIRS_CLOSED or _GLOO_TRANSPORT.match(message) is not None


def collective_detail(err: BaseException) -> str:
    """The first line of a failed collective's message without gloo's source location."""
    lines = str(err).strip().splitlines()
    return _SOURCE_LOCATION.sub("", lines[0]) if lines else type(err).__name__
