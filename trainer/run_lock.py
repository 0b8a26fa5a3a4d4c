"""One job per run folder: ``RUN/.lock``, taken by the job's rank 0 before anything in the
folder is read or written, held for the run's life.

Two jobs on one folder (the same command started twice, a scheduler's resubmission while an
orphaned copy still runs) would resume from each other's checkpoints, truncate each other's
metrics.jsonl and both write checkpoints. The lock is one file, read the same way from every
node of a shared file system:

- an ``fcntl`` (POSIX record) lock on it, which the kernel, or the NFS lock manager, drops
  when the holder dies however it dies (``kill -9``, the OOM killer, a node reboot). POSIX
  locks belong to the process, are not inherited by its DataLoader workers and end when the
  process closes *any* descriptor of the file, so the file is opened once and the heartbeat
  goes through that descriptor;
- a lease written in the file (host, pid, start time, heartbeat every :data:`HEARTBEAT_S`),
  which names the holder when another job is refused, and decides whether the holder lives
  where ``fcntl`` locks fail (``ENOLCK``: NFS mounted ``nolock``) or stay local to a node
  (``local_lock=all``): a lease from another host whose heartbeat is fresher than
  :data:`STALE_S` is alive, whatever the local lock says.

A holder that died leaves its lease behind: the next job takes the lock over and says so in
one line. A clean end empties the file. The heartbeat also checks that the file still names
this job; a job that finds another's lease there (it hung past :data:`STALE_S` and was taken
over) stops without a checkpoint (``trainer.stopping.StopReason.LOCK_LOST``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from data_pipeline.json_file import parse_json
from trainer.errors import Refused
from trainer.stopping import StopReason, StopRequests

LOCK_FILE = ".lock"
HEARTBEAT_S = 10.0
LEASE_BYTES = 4096  # a lease is ~100 bytes; a lock file's first 4 KiB are all that is read
STALE_S = 60.0  # a lease unrenewed this long belongs to a dead or hung job
_REREAD_S = 0.05
_NO_FCNTL = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunFolderInUse(Refused):
    """Another live job holds the run folder's lock."""


@dataclass(frozen=True)
class Lease:
    """Who holds a run folder: ``started`` and ``heartbeat`` are ``time.time()`` seconds."""

    host: str
    pid: int
    started: float
    heartbeat: float

    @classmethod
    def parse(cls, raw: bytes | None, where: str) -> Lease | None:
        """The lease stored as ``raw`` (a lock file's or object's bytes, read from ``where``);
        None when it is empty or not a lease (malformed, or a field of another type), which
        the lock treats as no holder."""
        if not raw:
            return None
        try:
            fields_ = parse_json(raw, where, "run lease", limit=LEASE_BYTES)
        except ValueError:
            return None
        types = {"host": str, "pid": int, "started": int | float, "heartbeat": int | float}
        if fields_.keys() != types.keys() or not all(
                isinstance(fields_[k], t) and not isinstance(fields_[k], bool)
                for k, t in types.items()):
            return None
        return cls(**fields_)

    def names(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"pid {self.pid} on {self.host}, since {since}"

    def same_job(self, other: Lease | None) -> bool:
        return other is not None and (self.host, self.pid, self.started) == (
            other.host, other.pid, other.started)

    def alive(self, here: str, now: float) -> bool:
        """Whether the lease's job runs, judged without ``fcntl``: its pid on this host, its
        heartbeat from another."""
        if self.host != here:
            return now - self.heartbeat < STALE_S
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class RunLock:
    """The lock on ``run_dir`` for this process (named ``host``, the machine's name unless a
    caller says otherwise). :meth:`acquire` once, :meth:`release` at the end. Should another
    job take the folder over, the heartbeat asks ``stops`` (the run's) to stop the run."""

    def __init__(self, run_dir: str | os.PathLike, host: str | None = None,
                 fcntl_locks: bool = True, stops: StopRequests | None = None):
        self.path = Path(run_dir) / LOCK_FILE
        self.stops = StopRequests() if stops is None else stops
        self.host = host or socket.gethostname()
        self.fcntl_locks = fcntl_locks  # False: the lease alone (a file system without them)
        self.lease: Lease | None = None
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Take the lock and start the heartbeat. Returns the one line to print when a dead
        job's lock was taken over (None otherwise); raises :class:`RunFolderInUse` naming
        the live holder and what to do."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            old, now = self._check(fd)
        except BaseException:
            os.close(fd)  # drops the fcntl lock taken above, if any
            raise
        self._fd = fd
        self.lease = Lease(self.host, os.getpid(), now, now)
        _write(fd, self.lease)
        self._beat = threading.Thread(target=self._heartbeat, name="run-lock", daemon=True)
        self._beat.start()
        if old is None:
            return None
        ago = now - old.heartbeat
        return (f"run lock: took over {self.path} from {old.names()} (last heartbeat "
                f"{ago:.0f} s ago): that job is gone")

    def probe(self) -> str | None:
        """Without taking the folder: the refusal :meth:`acquire` would raise now (another
        live job holds it), else None. What a launcher checks before it starts any rank, so
        a second job is refused at once and writes nothing into the first one's files."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError:  # no lock file (never run) or no folder: free
            return None
        try:
            self._check(fd)
        except RunFolderInUse as err:
            return str(err)
        finally:
            os.close(fd)  # drops the fcntl lock the check took
        return None

    def _check(self, fd: int) -> tuple[Lease | None, float]:
        """Take the fcntl lock on ``fd`` and read the lease; raises :class:`RunFolderInUse`
        when a live job holds the folder. Returns (the lease found, now)."""
        locked = self._lock(fd)
        old, now = _read(fd), time.time()
        # the lease decides where the fcntl lock cannot: no fcntl, or another node's
        lease_lives = old is not None and old.alive(self.host, now) and (
            locked is None or old.host != self.host)
        if locked is False or lease_lives:
            raise RunFolderInUse(self._refusal(old))
        return old, now

    def _lock(self, fd: int) -> bool | None:
        """True: the fcntl lock is ours; False: another process holds it; None: this file
        system has no fcntl locks (or ``fcntl_locks`` is off), the lease decides alone."""
        if not self.fcntl_locks:
            return None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EAGAIN, errno.EACCES):
                return False
            if err.errno in _NO_FCNTL:
                return None
            raise
        return True

    def _refusal(self, holder: Lease | None) -> str:
        who = holder.names() if holder is not None else "a job that is starting"
        return (f"{self.path.parent} is in use by another job ({who}): wait for it to end, "
                f"or give this run its own folder (output=...)")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.beat()

    def beat(self) -> bool:
        """Renew the lease; returns False (and asks the run to stop) when the file names
        another job."""
        if self._fd is None or self.lease is None:
            return False
        with contextlib.suppress(OSError):  # a full disk: the lease ages, the run goes on
            found = _read(self._fd)
            if found is None:  # another job's lease half written? look again before renewing
                time.sleep(_REREAD_S)
                found = _read(self._fd)
            if found is not None and not self.lease.same_job(found):
                self.stops.request(
                    StopReason.LOCK_LOST, f"{self.path.parent} was taken over by another job "
                    f"({found.names()}) while this one was not renewing its lease for "
                    f"{STALE_S:.0f} s; this job stops without a checkpoint")
                self._stop.set()
                return False
            self.lease = Lease(self.lease.host, self.lease.pid, self.lease.started,
                               time.time())
            _write(self._fd, self.lease)
        return True

    def release(self) -> None:
        """Stop the heartbeat and empty the file (when it still names this job); closing it
        drops the fcntl lock."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if self.lease is not None and self.lease.same_job(_read(self._fd)):
                os.ftruncate(self._fd, 0)
        os.close(self._fd)
        self._fd = None


def _read(fd: int) -> Lease | None:
    """The lease in the lock file, None when it is empty or not a lease."""
    return Lease.parse(os.pread(fd, LEASE_BYTES, 0), LOCK_FILE)


def _write(fd: int, lease: Lease) -> None:
    """Over the old lease, then cut to length: a reader never meets an empty file."""
    data = (json.dumps(asdict(lease)) + "\n").encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))
    os.fsync(fd)
