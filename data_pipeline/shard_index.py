"""Per-shard member index: where each sample's ``jpg`` and ``cls`` lie in its tar shard.

Parsing tar headers in Python every epoch cost a loader worker about a tenth of its time
(three members per sample; docs/benchmarks.md, "Loader"). So beside each shard ``NAME`` the
writer stores ``NAME.idx`` (a numpy ``.npz``: the sample keys and the byte ranges of their
``jpg`` and ``cls`` members), built from the checksum-verified parse, and the loader slices the
memory-mapped shard at those offsets: the same idea as DALI's ``wds2idx`` index files. A
folder converted without indexes still loads (the loader then parses the tars);
``python -m launch.convert index DIR`` adds them.

An index is checked against its shard before it is used: the shard's size, and the tar
headers of the first and last samples read naming those samples' keys and sizes. An index
left beside a rewritten shard is refused with a line naming the fix, never read at wrong
offsets.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from data_pipeline.errors import ShardError
from data_pipeline.manifest import ShardInfo, atomic_file, read_manifest
from data_pipeline.npz_file import read_npz
from data_pipeline.tar_reader import (
    BLOCK,
    check_shard,
    mapped,
    member_name,
    member_size,
    memory_map,
    sample_members,
)

INDEX_SUFFIX = ".idx"
FORMAT_VERSION = 1
COLUMNS = {"jpg": 0, "cls": 2}  # members' (offset, size) columns; -1 where a sample lacks one
MAX_INDEX_BYTES = 256 << 20  # a shard of 10^5 samples indexes in ~15 MB
REBUILD = ("rebuild the folder's indexes with `python -m launch.convert index DIR` (or delete "
           "the file: the loader then parses the tar)")


@dataclass(frozen=True)
class ShardIndex:
    """One shard's samples in order: ``keys`` (str ``[n]``) and ``members`` (int64
    ``[n, 4]``: jpg offset, jpg size, cls offset, cls size; -1 for a missing member), for a
    shard of ``shard_bytes`` bytes."""

    keys: np.ndarray
    members: np.ndarray
    shard_bytes: int


def index_path(shard: Path) -> Path:
    return shard.with_name(shard.name + INDEX_SUFFIX)


def build_index(shard: Path) -> ShardIndex:
    """The index of ``shard``, from the checksum-verified tar parse (ShardError when the shard
    is corrupt or truncated), its samples counted as every reader counts them
    (:func:`data_pipeline.tar_reader.sample_members`)."""
    try:
        with open(shard, "rb") as f, mapped(f) as data:
            return index_of(data, shard)
    except OSError as exc:
        raise ShardError(f"{shard}: unreadable ({type(exc).__name__}: {exc})") from exc


def index_of(data: mmap.mmap | bytes, shard: Path | str) -> ShardIndex:
    """The index of the shard whose bytes are ``data`` (``shard`` names it in errors)."""
    keys, rows = [], []
    for key, members in sample_members(data, shard):
        row = [-1, -1, -1, -1]
        for ext, offset, size in members:
            if ext in COLUMNS:
                row[COLUMNS[ext]:COLUMNS[ext] + 2] = offset, size
        keys.append(key)
        rows.append(row)
    return ShardIndex(np.array(keys, dtype=str), np.array(rows, np.int64).reshape(-1, 4),
                      len(data))


def write_index(shard: Path, index: ShardIndex) -> None:
    """Store ``index`` as ``shard``'s index file, atomically."""
    with atomic_file(index_path(shard)) as f:
        np.savez(f, version=FORMAT_VERSION, keys=index.keys, members=index.members,
                 shard_bytes=index.shard_bytes)


def index_folder(data_dir: str | os.PathLike, *, workers: int = 1,
                 progress: Callable[[int], None] | None = None) -> int:
    """Write (or rewrite) the index of every shard of a converted folder, in ``workers``
    processes; ``progress`` gets each shard's sample count. Returns the number of shards."""
    data_dir = Path(data_dir)
    shards = read_manifest(data_dir).shards
    jobs = [data_dir / s.name for s in shards], shards
    with ProcessPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:
        for count in (pool.map if pool else map)(_index_shard, *jobs):
            if progress:
                progress(count)
    return len(shards)


def _index_shard(shard: Path, info: ShardInfo) -> int:
    check_shard(shard, info)
    index = build_index(shard)
    if len(index.keys) != info.count:
        raise ShardError(f"{shard}: holds {len(index.keys)} samples, manifest says {info.count}")
    write_index(shard, index)
    return info.count


def same_index(a: ShardIndex, b: ShardIndex) -> bool:
    return (a.shard_bytes == b.shard_bytes and a.keys.tolist() == b.keys.tolist()
            and np.array_equal(a.members, b.members))


def read_index(shard: Path) -> ShardIndex | None:
    """``shard``'s index, None when it has none; ShardError naming the index file when it is
    unreadable or indexes a shard of another size."""
    path = index_path(shard)
    if not path.is_file():
        return None
    return parse_index(path, str(path), shard.stat().st_size)


def parse_index(source: Path | BinaryIO, where: str, shard_bytes: int) -> ShardIndex:
    """The index stored in ``source`` (a file, or a file object of its bytes; ``where`` names
    it in errors) of a shard of ``shard_bytes`` bytes; ShardError when it is unreadable or was
    made for a shard of another size."""
    stored = read_npz(source, ("version", "keys", "members", "shard_bytes"), where,
                      "shard index", limit=MAX_INDEX_BYTES, error=ShardError, hint=f"; {REBUILD}")
    try:
        version, keys, members = int(stored["version"]), stored["keys"], stored["members"]
        indexed_bytes = int(stored["shard_bytes"])
    except (TypeError, ValueError) as exc:  # a member of another shape: an array, not one int
        raise ShardError(f"{where}: not a version-{FORMAT_VERSION} shard index ({exc}); "
                         f"{REBUILD}") from None
    if (version != FORMAT_VERSION or members.shape != (len(keys), 4)
            or members.dtype.kind != "i" or keys.ndim != 1):
        raise ShardError(f"{where}: not a version-{FORMAT_VERSION} shard index; {REBUILD}")
    shard = where.removesuffix(INDEX_SUFFIX)
    if indexed_bytes != shard_bytes:
        raise ShardError(f"{shard}: {shard_bytes} bytes, its index {where.rsplit('/', 1)[-1]} "
                         f"was made for {indexed_bytes} (a truncated or rewritten shard; if the "
                         f"shard is right, {REBUILD})")
    offsets, sizes = members[:, 0::2], members[:, 1::2]
    absent = (offsets == -1) & (sizes == -1)
    outside = ~absent & ((offsets < BLOCK) | (sizes < 0) | (offsets + sizes > indexed_bytes))
    if outside.any():  # refused before a member is sliced or a byte range is requested
        row = int(np.flatnonzero(outside.any(1))[0])
        raise ShardError(f"{where}: sample {row} lies outside the {indexed_bytes} bytes of "
                         f"its shard; {REBUILD}")
    return ShardIndex(keys, members, indexed_bytes)


def check_positions(index: ShardIndex, positions: Sequence[int], where: str) -> None:
    """ShardError unless ``index`` (its file named by ``where``) reaches ``positions``."""
    if positions and positions[-1] >= len(index.keys):
        raise ShardError(f"{where}: indexes {len(index.keys)} samples, expected at least "
                         f"{positions[-1] + 1}; {REBUILD}")


def indexed_samples(shard: Path, index: ShardIndex, positions: Sequence[int]) -> Iterator[dict]:
    """The samples at ``positions`` (ascending) of ``shard``, as
    :func:`data_pipeline.tar_reader.tar_samples` gives them (``__key__``, ``jpg``, ``cls``),
    read at the offsets of its ``index``. ``jpg`` is a memoryview of the mapped shard, not a
    copy (the map stays while a sample in a shuffle buffer holds one); ``cls`` is bytes,
    which ``int`` reads. The shard is opened and checked when this is called, not when the
    samples are first asked for."""
    check_positions(index, positions, str(index_path(shard)))
    try:
        with open(shard, "rb") as f:
            data = memory_map(f)
    except OSError as exc:
        raise ShardError(f"{shard}: unreadable ({type(exc).__name__}: {exc})") from exc
    for position in (positions[0], positions[-1]) if positions else ():
        offset, size = index.members[position, :2].tolist()
        check_member(data[max(0, offset - BLOCK):offset], shard, index.keys[position], offset,
                     size)
    return _sliced(data, index.keys[positions].tolist(), index.members[positions].tolist())


def _sliced(data, keys: list[str], rows: list[list[int]]) -> Iterator[dict]:
    """The samples whose members lie at ``rows`` of the mapped shard ``data``."""
    view = memoryview(data)
    for key, (jpg, jpg_size, cls, cls_size) in zip(keys, rows, strict=True):
        sample = {"__key__": key}
        if jpg_size >= 0:
            sample["jpg"] = view[jpg:jpg + jpg_size]
        if cls_size >= 0:
            sample["cls"] = data[cls:cls + cls_size]
        yield sample


def check_member(header: bytes, shard: Path | str, key: str, offset: int, size: int) -> None:
    """ShardError unless ``header``, the 512 bytes before ``offset`` in ``shard``, is
    ``key``'s jpg of ``size`` bytes (or the sample has no jpg: nothing to check)."""
    if offset < 0:
        return
    try:
        matches = (len(header) == BLOCK and member_name(header) == f"{key}.jpg"
                   and member_size(header) == size)
    except UnicodeDecodeError:
        matches = False
    if not matches:
        name = str(shard).rsplit("/", 1)[-1]
        raise ShardError(f"{shard}{INDEX_SUFFIX}: does not match {name} (no member "
                         f"{key}.jpg of {size} bytes at byte {offset}); {REBUILD}")
