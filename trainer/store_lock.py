"""One job per run folder where the folder is in an object store: the lease object
``URL/.lock``, taken with a conditional write, renewed by a heartbeat.

A store has no ``fcntl`` and no rename, but it has one atomic step: create an object only
where none exists (``data_pipeline.store.StoreFolder.create``: S3 ``If-None-Match: *``, GCS
``ifGenerationMatch=0``, Azure ``If-None-Match: *``). The job whose create succeeds holds
the folder; the lease in the object (:class:`~trainer.run_lock.Lease`: host, pid, start,
heartbeat) names it to a job that is refused, and its heartbeat (every
:data:`~trainer.run_lock.HEARTBEAT_S`) says whether it lives: a lease unrenewed for
:data:`~trainer.run_lock.STALE_S` belongs to a dead or hung job, and the next job takes it
over (deletes it and creates its own, which again only one job can do) with one line. A store
that ignores the condition is refused in one line (``output_lock=false`` runs without a lock).

The heartbeat reads the lease before renewing it; a job that finds another's there (it hung
past STALE_S and was taken over) stops without a checkpoint, as with a local folder. Between
that read and the renewal a takeover can slip in unseen for one period; the next beat sees
it. Heartbeats are wall-clock seconds of the holder's host: hosts whose clocks differ by
more than STALE_S - HEARTBEAT_S misjudge each other.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import asdict

from data_pipeline.store import StorageError, StoreFolder
from trainer import run_lock
from trainer.errors import Refused
from trainer.run_lock import LOCK_FILE, STALE_S, Lease, RunFolderInUse
from trainer.stopping import StopReason, StopRequests


class LeaseRefused(Refused):
    """The store cannot hold the lease: it ignores conditional writes, or it failed."""


class StoreLock:
    """The lease on the run folder ``store`` for this process (named ``host``, the
    machine's name unless a caller says otherwise), with :class:`~trainer.run_lock.RunLock`'s
    calls: :meth:`acquire` once, :meth:`release` at the end, :meth:`probe` to ask."""

    def __init__(self, store: StoreFolder, host: str | None = None,
                 stops: StopRequests | None = None):
        self.store = store
        self.stops = StopRequests() if stops is None else stops
        self.host = host or socket.gethostname()
        self.lease: Lease | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Create the lease and start the heartbeat. Returns the one line to print when a
        dead job's lease was taken over (None otherwise); raises :class:`RunFolderInUse`
        naming the live holder, :class:`LeaseRefused` for a store without the condition or
        out of reach."""
        try:
            return self._acquire()
        except StorageError as err:
            raise LeaseRefused(f"run lock: {err}") from None

    def _acquire(self) -> str | None:
        now = time.time()
        mine = Lease(self.host, os.getpid(), now, now)
        old = None
        if not self.store.create(LOCK_FILE, _encode(mine)):
            old = self._read()
            if old is not None and old.alive(self.host, now):
                raise RunFolderInUse(self._refusal(old))
            self.store.remove(LOCK_FILE)  # a dead job's: only one taker's create succeeds
            if not self.store.create(LOCK_FILE, _encode(mine)):
                raise RunFolderInUse(self._refusal(self._read()))
        self.lease = mine
        self._beat = threading.Thread(target=self._heartbeat, name="run-lease", daemon=True)
        self._beat.start()
        if old is None:
            return None
        return (f"run lock: took over {self.store.url_of(LOCK_FILE)} from {old.names()} (last "
                f"heartbeat {now - old.heartbeat:.0f} s ago): that job is gone")

    def probe(self) -> str | None:
        """The refusal :meth:`acquire` would raise now, else None; takes nothing."""
        held = self._read()
        return self._refusal(held) if held is not None and held.alive(self.host, time.time()) \
            else None

    def _refusal(self, holder: Lease | None) -> str:
        who = holder.names() if holder is not None else "a job that is starting"
        return (f"{self.store.shown} is in use by another job ({who}): wait for it to end, or "
                "give this run its own folder (output=...)")

    def _read(self) -> Lease | None:
        return Lease.parse(self.store.get(LOCK_FILE), self.store.url_of(LOCK_FILE))

    def _heartbeat(self) -> None:
        # the period read at each wait, as RunLock reads it (a module value bound at import
        # would keep whatever it was then)
        while not self._stop.wait(run_lock.HEARTBEAT_S):
            self.beat()

    def beat(self) -> bool:
        """Renew the lease; returns False (and asks the run to stop) when the store holds
        another job's."""
        if self.lease is None:
            return False
        with contextlib.suppress(StorageError):  # a store out of reach: the lease ages
            found = self._read()
            if found is not None and not self.lease.same_job(found):
                self.stops.request(
                    StopReason.LOCK_LOST, f"{self.store.shown} was taken over by another job "
                    f"({found.names()}) while this one was not renewing its lease for "
                    f"{STALE_S:.0f} s; this job stops without a checkpoint")
                self._stop.set()
                return False
            self.lease = Lease(self.lease.host, self.lease.pid, self.lease.started, time.time())
            self.store.put(LOCK_FILE, _encode(self.lease))
        return True

    def release(self) -> None:
        """Stop the heartbeat and delete the lease when it still names this job."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if self.lease is not None:
            with contextlib.suppress(StorageError):
                if self.lease.same_job(self._read()):
                    self.store.remove(LOCK_FILE)
            self.lease = None


def _encode(lease: Lease) -> bytes:
    return (json.dumps(asdict(lease)) + "\n").encode()
