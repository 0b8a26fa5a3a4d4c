"""The lock of a run folder wherever it lives, taken by the job's rank 0 for the run's life:
:class:`~trainer.run_lock.RunLock` (a file with an ``fcntl`` lock and a lease) on a local or
shared folder, :class:`~trainer.store_lock.StoreLock` (a lease object taken with a conditional
write) for a folder at an object store's URL. Both modules define their lock; this one only
picks between them and makes the outcome collective, so neither imports the other.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from data_pipeline.store import in_store, local_path, open_store
from trainer.dist import DistEnv
from trainer.run_lock import RunFolderInUse, RunLock
from trainer.stopping import StopRequests
from trainer.store_lock import LeaseRefused, StoreLock


def open_lock(location: str, stops: StopRequests | None = None):
    """The lock of the run folder ``location``: a :class:`RunLock` on a local (or shared)
    folder, a lease in the store for a URL (``trainer.store_lock.StoreLock``)."""
    if not in_store(location):
        return RunLock(local_path(location), stops=stops)
    return StoreLock(open_store(location), stops=stops)


@contextlib.contextmanager
def run_folder_lock(location: str, run_dir: Path, env: DistEnv, stops: StopRequests,
                    held: bool = True) -> Iterator[None]:
    """Collective: rank 0 holds the lock of the run folder ``location`` (``run_dir`` on this
    machine) for the block (a takeover asks ``stops``, the run's, to stop; ``held=False``:
    no lock, ``output_lock=false``). Every rank learns the outcome, so a refusal ends every
    rank with the same :class:`~trainer.errors.Refused` (rank 0 prints it) before anything in
    the folder is read; a takeover is said by rank 0."""
    from trainer.telemetry.console import append_log

    lock = None
    answer: list = [None, None]  # [refusal, takeover line]
    if env.is_main and held:
        try:
            lock = open_lock(location, stops)
            answer[1] = lock.acquire()
        except (RunFolderInUse, LeaseRefused) as err:
            answer[0] = err
    if env.world_size > 1:
        dist.broadcast_object_list(answer, src=0, group=env.group)
    if answer[0] is not None:
        raise answer[0]
    if lock is not None and answer[1] is not None:
        print(answer[1], file=sys.stderr, flush=True)
        append_log(run_dir, answer[1])
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
