"""A node-local cache of a remote folder's shards (``data.cache_dir``, ``data.cache_gib``).

A shard is fetched whole once, with its member index, into ``CACHE_DIR/<folder id>/`` and read
from there like a local shard in every later epoch. The ranks and workers of a node share the
cache through one lock file per shard (``flock``): a process that finds the shard missing
takes the lock exclusively and fetches it, the others wait and then read what it fetched, so a
shard crosses the network once per node; a reader holds the lock shared while it opens the
shard (its memory map outlives an eviction), never while it hands out samples. A fetch is
written under a temporary name and renamed into place only when its size, and its SHA-256
where the manifest has one, match the manifest (the index is renamed first: a shard's
presence means both are whole), so a half-written file is never read, not even after a
crash. When the cache holds more than ``cache_gib``, the shards read least recently (a file's
mtime is its last read) that no process holds are evicted; the shard just fetched stays even
if it alone is larger.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from data_pipeline.errors import ShardError
from data_pipeline.manifest import ShardInfo, fsync_dir
from data_pipeline.remote import RemoteFolder
from data_pipeline.shard_index import INDEX_SUFFIX, parse_index

_NOT_SHARDS = (".lock", ".tmp", INDEX_SUFFIX)


class ShardCache:
    """The cache folder of one remote folder under ``root``, bounded to ``gib`` GiB; fetches
    go through ``folder`` in requests of ``block`` bytes. ``fetched`` counts the shards this
    process fetched."""

    def __init__(self, root: str | os.PathLike, gib: float, folder: RemoteFolder, block: int):
        self.dir = Path(root) / hashlib.sha256(folder.url.encode()).hexdigest()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.limit, self.folder, self.block = int(gib * (1 << 30)), folder, block
        self.fetched = 0

    def fetch(self, info: ShardInfo, indexed: bool) -> Path:
        """Shard ``info``'s path in the cache (with its index when ``indexed``), fetched now
        unless it, or another process that held its lock first, had it already."""
        path = self.dir / info.name
        if path.is_file():
            return path
        with _locked(self._lock(info.name), fcntl.LOCK_EX):
            if not path.is_file():
                self._download(info, indexed)
        self._evict(keep=path)
        return path

    @contextlib.contextmanager
    def reading(self, info: ShardInfo, indexed: bool) -> Iterator[Path]:
        """Shard ``info``'s cached copy, kept from eviction while the block runs (fetched
        first if it is not there): open it there, and wait for nothing inside (a worker
        waiting for its turn to hand out a chunk would hold up every other). Its mtime
        records the read."""
        path = self.dir / info.name
        while True:
            with _locked(self._lock(info.name), fcntl.LOCK_SH):
                if path.is_file():
                    os.utime(path)
                    yield path
                    return
            self.fetch(info, indexed)

    def _lock(self, name: str) -> Path:
        return self.dir / f"{name}.lock"

    def _download(self, info: ShardInfo, indexed: bool) -> None:
        """Fetch shard ``info`` (and its index) under temporary names, check it against the
        manifest, rename it into place. Called with the shard's lock held exclusively."""
        where, name = f"{self.folder.shown}/{info.name}", info.name
        tag = f"{os.getpid()}-{threading.get_ident()}.tmp"
        if indexed:
            raw = self.folder.read(name + INDEX_SUFFIX)
            parse_index(io.BytesIO(raw), where + INDEX_SUFFIX, info.bytes)  # refused if stale
            tmp = self.dir / f"{name}{INDEX_SUFFIX}.{tag}"
            tmp.write_bytes(raw)
            os.replace(tmp, self.dir / (name + INDEX_SUFFIX))
        tmp = self.dir / f"{name}.{tag}"
        try:
            with open(tmp, "wb") as f:
                digest = self.folder.copy_to(name, f, info.bytes, self.block)
                f.flush()
                os.fsync(f.fileno())
            size = tmp.stat().st_size
            if size != info.bytes:
                raise ShardError(f"{where}: fetched {size} bytes, manifest says {info.bytes}")
            if info.sha256 and digest != info.sha256:
                raise ShardError(f"{where}: SHA-256 {digest[:16]}... differs from "
                                 f"the manifest's {info.sha256[:16]}... (a rewritten shard: "
                                 "convert the set again, or restore the shard)")
            os.replace(tmp, self.dir / name)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.dir)
        self.fetched += 1

    def _evict(self, keep: Path) -> None:
        """Remove the least recently read shards no process holds until the cache fits."""
        shards = []
        for path in self.dir.iterdir():
            if path.name.endswith(_NOT_SHARDS):
                continue
            with contextlib.suppress(FileNotFoundError):
                index = path.with_name(path.name + INDEX_SUFFIX)
                size = path.stat().st_size + (index.stat().st_size if index.exists() else 0)
                shards.append((path.stat().st_mtime, path, size))
        total = sum(size for _, _, size in shards)
        for _, path, size in sorted(shards):
            if total <= self.limit:
                return
            if path == keep:
                continue
            try:
                with _locked(self._lock(path.name), fcntl.LOCK_EX | fcntl.LOCK_NB):
                    path.unlink(missing_ok=True)  # the shard first: its presence means whole
                    path.with_name(path.name + INDEX_SUFFIX).unlink(missing_ok=True)
            except BlockingIOError:  # being read or fetched
                continue
            total -= size


@contextlib.contextmanager
def _locked(path: Path, mode: int) -> Iterator[None]:
    """``flock`` on the file ``path`` (created if missing) for the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)
