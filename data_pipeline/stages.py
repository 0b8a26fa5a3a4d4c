"""Loader stages: plain generators over sample dicts, curried with `wds.pipelinefilter`.

A worker's stream is  read_pieces -> shuffle (webdataset's buffer, seeded) -> annotate
(stream position and flip bit) -> skip (resume) -> decode_chunks (into a batch buffer).
Positions are taken after the shuffle, so a resumed worker replays the same shuffled stream
without decoding and skips exactly the samples it had handed out. Sample dicts carry
`__key__`, `jpg` (bytes), `cls` (bytes), `__pos__`, `__flip__`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import random
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import webdataset as wds

from data_pipeline.codec import decode_into
from data_pipeline.epoch_plan import Piece
from data_pipeline.errors import CorruptImageError, DataError, ShardError
from data_pipeline.manifest import ShardInfo
from data_pipeline.slots import SlotPool

CORRUPT = "__corrupt__"
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
    seen, current = 0, None  # samples started so far; the one being assembled (number seen-1)
    wanted = False  # whether the sample being assembled is yielded
    try:
        with open(path, "rb") as f, _mapped(f) as data:
            for name, offset, size in _tar_members(data, path):
                # webdataset's key convention: folder/stem, the stem ending at the first dot
                dot = name.find(".", name.rfind("/") + 1)
                key, ext = (name[:dot], name[dot + 1:]) if dot >= 0 else (name, "")
                if current is None or key != current["__key__"]:
                    if wanted:
                        yield current
                    if seen == stop:
                        return
                    current, seen = {"__key__": key}, seen + 1
                    wanted = seen > start and seen - 1 not in drop
                if wanted and (exts is None or ext in exts):
                    current[ext] = data[offset:offset + size]
                    if len(current[ext]) != size:
                        raise ShardError(f"{path}: member {name} truncated")
    except OSError as exc:
        raise ShardError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from exc
    if wanted:
        yield current
    if stop is not None and seen < stop:
        raise ShardError(f"{path}: holds {seen} samples, expected at least {stop} "
                         "(truncated shard)")


@contextlib.contextmanager
def _mapped(f) -> Iterator[mmap.mmap | bytes]:
    """The open file ``f`` as a read-only memory map (an empty file, which cannot be mapped,
    as empty bytes: the tar reader then reports it truncated)."""
    if os.fstat(f.fileno()).st_size == 0:
        yield b""
        return
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        yield data


def _tar_members(data: mmap.mmap | bytes, path: Path) -> Iterator[tuple[str, int, int]]:
    """(name, data offset, size) of each regular file in a ustar archive held in ``data``.

    A small reader instead of `tarfile`, whose per-member Python overhead cost more than the
    JPEG decode (docs/benchmarks.md, "Loader"). Headers are checksum-verified, a block of
    them at a time with numpy (summing 512 bytes in Python cost a tenth of a worker's time);
    member types other than regular files and directories (GNU long names, pax) are refused:
    shards come from this package's writer.
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
            try:  # the writer's form: 11 octal digits and a NUL
                size = int(header[124:135], 8)
            except ValueError:
                size = _octal(header[124:136])
            if size is None:
                raise ShardError(f"{path}: corrupt tar header at byte {offset}")
            kind = header[156:157]
            end = header.find(b"\0", 0, 100)
            name = header[:end if end >= 0 else 100].decode()
            if header[257:262] == b"ustar" and header[345] != 0:
                name = header[345:500].split(b"\0", 1)[0].decode() + "/" + name
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


def read_pieces(pieces: list[Piece], paths: list[Path], infos: list[ShardInfo]) -> Iterator[dict]:
    """Source stage: the raw samples of `pieces` in order (less each piece's `drop`); shards
    are checked before reading."""
    for piece in pieces:
        check_shard(paths[piece.shard], infos[piece.shard])
        for sample in tar_samples(paths[piece.shard], piece.start, piece.stop, piece.drop,
                                  exts=("jpg", "cls")):
            sample["__shard__"] = paths[piece.shard]
            yield sample


def _annotate(data: Iterator[dict], seed: str, flip: bool) -> Iterator[dict]:
    """Number the stream (`__pos__`) and draw each sample's flip bit from a seeded generator."""
    rng = random.Random(seed)
    for pos, sample in enumerate(data):
        sample["__pos__"] = pos
        sample["__flip__"] = flip and rng.random() < 0.5
        yield sample


def _skip(data: Iterator[dict], count: int) -> Iterator[dict]:
    for sample in data:
        if sample["__pos__"] >= count:
            yield sample


class Chunk(NamedTuple):
    """Up to `batch_size` decoded samples of one worker's stream, as a worker hands them to
    the main process (a NamedTuple: DataLoader's pin_memory copies it field by field). From a
    worker with a :class:`SlotPool` the images stay in the pool (``images`` None, ``slot``
    the worker's chunk number) and the labels are a list (a tensor would cost a shared-memory
    segment); the main process turns both into tensors (``SlotPool.receive``)."""

    images: torch.Tensor | None  # uint8 [b, 3, H, W], channels_last strides
    labels: torch.Tensor | list[int]  # int64 [b]
    keys: list[str]
    positions: list[int]  # stream position of each sample
    end: int  # stream position after everything the chunk accounts for
    skipped: list[int]  # stream positions of the corrupt samples dropped while filling it
    worker: int
    slot: int = -1  # the worker's chunk number, when the images are in its SlotPool


def _decode_chunks(data: Iterator[dict], size: int, decoder: str, batch_size: int, worker: int,
                   num_classes: int | None = None, pool: SlotPool | None = None
                   ) -> Iterator[Chunk]:
    """Decode `jpg` straight into the rows of a ``[batch_size, size, size, 3]`` buffer
    (mirrored where the flip was drawn: ``codec.decode_into``) and emit it as a
    :class:`Chunk` when full (the last one may be partial, or empty when it only passed over
    corrupt samples). The buffers are ``pool``'s slots in a DataLoader worker, fresh
    tensors otherwise; the stream ends early when the pool's reader has gone.

    Undecodable samples are dropped and their positions recorded in ``Chunk.skipped``. A label
    outside ``[0, num_classes)`` is not corruption but data that contradicts its manifest: a
    :class:`DataError` naming the shard and the sample's key.
    """
    batch, end = _Filling(batch_size, size, pool, worker, 0), None
    for sample in data:
        if batch.array is None:
            return
        end = sample["__pos__"] + 1
        try:
            label = int(sample["cls"])
            decode_into(sample["jpg"], batch.array[len(batch.keys)], decoder, sample["__flip__"])
        except (CorruptImageError, ValueError, KeyError):
            batch.skipped.append(sample["__pos__"])
            continue
        if num_classes is not None and not 0 <= label < num_classes:
            raise DataError(f"{sample.get('__shard__', 'shard')}: sample {sample['__key__']!r} "
                            f"has label {label}, outside [0, {num_classes}) of manifest.json")
        batch.labels.append(label)
        batch.keys.append(sample["__key__"])
        batch.positions.append(sample["__pos__"])
        if len(batch.keys) == batch_size:
            yield batch.chunk(end)
            batch = _Filling(batch_size, size, pool, worker, batch.index + 1)
    if batch.array is not None and (batch.keys or batch.skipped):
        yield batch.chunk(end)


class _Filling:
    """The chunk being filled: its ``[batch_size, size, size, 3]`` buffer (``array``, a view
    for the decoder; None when ``pool`` has no reader any more) and the bookkeeping of its
    rows. ``index`` numbers the worker's chunks (its pool slots go round in that order)."""

    def __init__(self, batch_size: int, size: int, pool: SlotPool | None, worker: int,
                 index: int):
        if pool is None:
            self.images = torch.empty((batch_size, size, size, 3), dtype=torch.uint8)
        else:
            self.images = pool.acquire(worker, index)
        self.array = self.images.numpy() if self.images is not None else None
        self.pooled, self.worker, self.index = pool is not None, worker, index
        self.labels, self.keys, self.positions = [], [], []
        self.skipped: list[int] = []

    def chunk(self, end: int) -> Chunk:
        """The filled rows as a chunk (images: a channels_last view, no copy; or left in the
        pool's slot)."""
        images = None if self.pooled else self.images[:len(self.keys)].permute(0, 3, 1, 2)
        return Chunk(images=images, labels=self.labels, keys=self.keys,
                     positions=self.positions, end=end, skipped=self.skipped,
                     worker=self.worker, slot=self.index if self.pooled else -1)


annotate = wds.pipelinefilter(_annotate)
skip = wds.pipelinefilter(_skip)
decode_chunks = wds.pipelinefilter(_decode_chunks)
