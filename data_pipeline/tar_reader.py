"""Reading tar shards: the ustar members of a memory-mapped shard, checksum-verified.

A small reader instead of `tarfile`, whose per-member Python overhead cost more than the JPEG
decode (docs/benchmarks.md, "Loader"). The loader reads a shard through its member index
(data_pipeline.shard_index) when it has one; this parse is what builds that index, and what
every other reader (verify, cleaning, overlap, exclusion lists) goes through.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Collection, Iterator
from pathlib import Path

import numpy as np

from data_pipeline.errors import ShardError
from data_pipeline.manifest import ShardInfo

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
CHECK_EVERY = 256  # tar headers verified together


def check_shard(path: Path, info: ShardInfo) -> None:
    """ShardError naming the file when it is missing or its size differs from the manifest."""
    if not path.is_file():
        raise ShardError(f"{path}: shard listed in the manifest is missing")
    size = path.stat().st_size
    if size != info.bytes:
        raise ShardError(f"{path}: {size} bytes on disk, manifest says {info.bytes} "
                         "(truncated or rewritten shard)")


def tar_samples(path: Path, start: int = 0, stop: int | None = None, drop: Collection[int] = (),
                exts: Collection[str] | None = None) -> Iterator[dict]:
    """Samples [start, stop) of a tar shard (all from `start` when stop is None) as dicts
    {"__key__": key, ext: bytes, ...}; members of earlier samples, of the samples numbered in
    `drop` (positions in the shard) and, with `exts`, of other extensions are passed over,
    not copied.

    The shard is memory-mapped: a member is a slice of the map, not a read() call (six
    system calls per sample cost a third of the loader's time next to the JPEG decode).
    """
    seen = 0  # samples started so far
    try:
        with open(path, "rb") as f, mapped(f) as data:
            for number, (key, members) in enumerate(sample_members(data, path)):
                if number == stop:
                    return
                seen = number + 1
                if number < start or number in drop:
                    continue
                sample = {"__key__": key}
                for ext, offset, size in members:
                    if exts is None or ext in exts:
                        sample[ext] = data[offset:offset + size]
                yield sample
    except OSError as exc:
        raise ShardError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from exc
    if stop is not None and seen < stop:
        raise ShardError(f"{path}: holds {seen} samples, expected at least {stop} "
                         "(truncated shard)")


def sample_members(data: mmap.mmap | bytes, path: Path
                   ) -> Iterator[tuple[str, list[tuple[str, int, int]]]]:
    """The samples of a ustar archive held in ``data``: ``(key, [(extension, data offset,
    size), ...])`` for each run of consecutive members with one key (:func:`split_name`),
    as the loader, its member index and every other reader count them. ShardError for a
    member that runs past the end of ``data``."""
    key, members = None, []
    for name, offset, size in tar_members(data, path):
        if offset + size > len(data):
            raise ShardError(f"{path}: member {name} truncated")
        member_key, ext = split_name(name)
        if member_key != key:
            if members:
                yield key, members
            key, members = member_key, []
        members.append((ext, offset, size))
    if members:
        yield key, members


def split_name(name: str) -> tuple[str, str]:
    """(key, extension) of a member name, webdataset's convention: the key is folder/stem,
    the stem ending at the first dot of the file name."""
    dot = name.find(".", name.rfind("/") + 1)
    return (name[:dot], name[dot + 1:]) if dot >= 0 else (name, "")


def member_name(header: bytes) -> str:
    """The member name a 512-byte ustar header holds (prefix field joined when set);
    UnicodeDecodeError when it is not UTF-8."""
    end = header.find(b"\0", 0, 100)
    name = header[:end if end >= 0 else 100].decode()
    if header[257:262] == b"ustar" and header[345] != 0:
        name = header[345:500].split(b"\0", 1)[0].decode() + "/" + name
    return name


def memory_map(f) -> mmap.mmap | bytes:
    """The open file ``f`` as a read-only memory map (an empty file, which cannot be mapped,
    as empty bytes: the tar reader then reports it truncated). It stays mapped, after ``f`` is
    closed, until it and every view of it are gone."""
    if os.fstat(f.fileno()).st_size == 0:
        return b""
    return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


@contextlib.contextmanager
def mapped(f) -> Iterator[mmap.mmap | bytes]:
    """:func:`memory_map` of ``f``, unmapped on exit."""
    data = memory_map(f)
    try:
        yield data
    finally:
        if isinstance(data, mmap.mmap):
            data.close()


def member_size(header: bytes) -> int | None:
    """The size field of a ustar header; None when unreadable."""
    try:  # the writer's form: 11 octal digits and a NUL
        return int(header[124:135], 8)
    except ValueError:
        return _octal(header[124:136])


def tar_members(data: mmap.mmap | bytes, path: Path) -> Iterator[tuple[str, int, int]]:
    """(name, data offset, size) of each regular file in a ustar archive held in ``data``.

    Headers are checksum-verified, a block of them at a time with numpy (summing 512 bytes in
    Python cost a tenth of a worker's time); member types other than regular files and
    directories (GNU long names, pax) are refused: shards come from this package's writer.
    """
    offset, headers, members = 0, [], []
    try:
        while True:
            header = data[offset:offset + BLOCK]
            if len(header) < BLOCK:
                raise ShardError(f"{path}: truncated shard (no end-of-archive block after "
                                 f"byte {offset})")
            if header == ZERO_BLOCK:
                break
            headers.append(offset)
            size = member_size(header)
            if size is None:
                raise ShardError(f"{path}: corrupt tar header at byte {offset}")
            kind = header[156:157]
            name = member_name(header)
            if kind in (b"0", b"\0"):
                members.append((name, offset + BLOCK, size))
            elif kind != b"5":
                raise ShardError(f"{path}: tar member {name!r} has unsupported type {kind!r} "
                                 "(write shards with launch.convert)")
            offset += BLOCK + -(-size // BLOCK) * BLOCK
            if len(headers) == CHECK_EVERY:
                _check_headers(data, headers, path)
                yield from members
                headers, members = [], []
    except (ShardError, UnicodeDecodeError) as exc:  # a corrupt header explains it first
        _check_headers(data, headers, path)
        if isinstance(exc, ShardError):
            raise
        raise ShardError(f"{path}: tar member name is not UTF-8 ({exc})") from exc
    _check_headers(data, headers, path)
    yield from members


def _octal(field: bytes) -> int | None:
    """A tar number field (octal digits, NUL/space padded); None when unreadable."""
    try:
        return int(field.split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        return None


def _check_headers(data: mmap.mmap | bytes, offsets: list[int], path: Path) -> None:
    """ShardError naming the first header at ``offsets`` whose checksum (the unsigned sum of
    its bytes, the checksum field counted as spaces) differs from the one it stores."""
    if not offsets:
        return
    view = np.frombuffer(data, np.uint8)
    rows = view[np.asarray(offsets)[:, None] + np.arange(BLOCK)]
    del view  # the map cannot close while an array exports it
    actual = rows.sum(1, dtype=np.int64) - rows[:, 148:156].sum(1, dtype=np.int64) + 256
    digits = rows[:, 148:154].astype(np.int64) - ord("0")
    plain = ((digits >= 0) & (digits < 8)).all(1) & (rows[:, 154] == 0)  # tarfile's "%06o\0 "
    stored = np.where(plain, digits @ (8 ** np.arange(5, -1, -1)), -1)
    for i in np.flatnonzero(~plain):
        stored[i] = _octal(rows[i, 148:156].tobytes()) or -1
    bad = np.flatnonzero(stored != actual)
    if len(bad):
        raise ShardError(f"{path}: corrupt tar header at byte {offsets[bad[0]]}")
