"""Loader stages: plain generators over sample dicts, curried with `wds.pipelinefilter`.

A worker's stream is  read_pieces -> shuffle (webdataset's buffer, seeded) -> annotate
(stream position and flip bit) -> skip (resume) -> decode -> chunk.  Positions are taken after
the shuffle, so a resumed worker replays the same shuffled stream without decoding and skips
exactly the samples it had handed out. Sample dicts carry `__key__`, `jpg` (bytes), `cls`
(bytes), `__pos__`, `__flip__`; after decode `image` (HWC uint8) replaces `jpg`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import webdataset as wds

from data_pipeline.codec import decode_image
from data_pipeline.epoch_plan import Piece
from data_pipeline.errors import CorruptImageError, DataError, ShardError
from data_pipeline.manifest import ShardInfo

CORRUPT = "__corrupt__"
BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)


def check_shard(path: Path, info: ShardInfo) -> None:
    """ShardError naming the file when it is missing or its size differs from the manifest."""
    if not path.is_file():
        raise ShardError(f"{path}: shard listed in the manifest is missing")
    size = path.stat().st_size
    if size != info.bytes:
        raise ShardError(f"{path}: {size} bytes on disk, manifest says {info.bytes} "
                         "(truncated or rewritten shard)")


def tar_samples(path: Path, start: int = 0, stop: int | None = None) -> Iterator[dict]:
    """Samples [start, stop) of a tar shard (all from `start` when stop is None) as dicts
    {"__key__": key, ext: bytes, ...}; members of earlier samples are seeked over, not read.
    """
    seen, current = 0, None  # samples started so far; the one being assembled (number seen-1)
    try:
        with open(path, "rb") as f:
            for name, offset, size in _tar_members(f, path):
                folder, _, base = name.rpartition("/")
                stem, _, ext = base.partition(".")
                key = f"{folder}/{stem}" if folder else stem  # webdataset's key convention
                if current is None or key != current["__key__"]:
                    if current is not None and seen > start:
                        yield current
                    if seen == stop:
                        return
                    current, seen = {"__key__": key}, seen + 1
                if seen > start:
                    f.seek(offset)
                    current[ext] = f.read(size)
                    if len(current[ext]) != size:
                        raise ShardError(f"{path}: member {name} truncated")
    except OSError as exc:
        raise ShardError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from exc
    if current is not None and seen > start:
        yield current
    if stop is not None and seen < stop:
        raise ShardError(f"{path}: holds {seen} samples, expected at least {stop} "
                         "(truncated shard)")


def _tar_members(f, path: Path) -> Iterator[tuple[str, int, int]]:
    """(name, data offset, size) of each regular file in a ustar archive.

    A small reader instead of `tarfile`, whose per-member Python overhead cost more than the
    JPEG decode (docs/benchmarks.md, "Loader"). Headers are checksum-verified;
    member types other than regular files and directories (GNU long names, pax) are refused:
    shards come from this package's writer.
    """
    offset = 0
    while True:
        f.seek(offset)
        header = f.read(BLOCK)
        if len(header) < BLOCK:
            raise ShardError(f"{path}: truncated shard (no end-of-archive block after byte "
                             f"{offset})")
        if header == ZERO_BLOCK:
            return
        try:
            checksum = int(header[148:156].split(b"\0")[0].strip() or b"0", 8)
            size = int(header[124:136].split(b"\0")[0].strip() or b"0", 8)
        except ValueError:
            checksum = size = -1
        if checksum != sum(header[:148]) + 256 + sum(header[156:]):
            raise ShardError(f"{path}: corrupt tar header at byte {offset}")
        kind = header[156:157]
        name = header[:100].split(b"\0")[0].decode()
        prefix = header[345:500].split(b"\0")[0].decode() if header[257:262] == b"ustar" else ""
        if prefix:
            name = f"{prefix}/{name}"
        if kind in (b"0", b"\0"):
            yield name, offset + BLOCK, size
        elif kind != b"5":
            raise ShardError(f"{path}: tar member {name!r} has unsupported type {kind!r} "
                             "(write shards with launch.convert)")
        offset += BLOCK + -(-size // BLOCK) * BLOCK


def read_pieces(pieces: list[Piece], paths: list[Path], infos: list[ShardInfo]) -> Iterator[dict]:
    """Source stage: the raw samples of `pieces` in order; shards are checked before reading."""
    for piece in pieces:
        check_shard(paths[piece.shard], infos[piece.shard])
        for sample in tar_samples(paths[piece.shard], piece.start, piece.stop):
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


def _decode(data: Iterator[dict], size: int, decoder: str,
            num_classes: int | None = None) -> Iterator[dict]:
    """Decode `jpg` to `image` (flipped if drawn); corrupt samples become CORRUPT markers.

    A label outside ``[0, num_classes)`` is not corruption but data that contradicts its
    manifest: a :class:`DataError` naming the shard and the sample's key.
    """
    for sample in data:
        try:
            if "jpg" not in sample or "cls" not in sample:
                raise CorruptImageError("sample lacks jpg or cls")
            label = int(sample["cls"])
            image = decode_image(sample["jpg"], size, decoder)
        except (CorruptImageError, ValueError):
            yield {CORRUPT: True, "__key__": sample["__key__"], "__pos__": sample["__pos__"]}
            continue
        if num_classes is not None and not 0 <= label < num_classes:
            raise DataError(f"{sample.get('__shard__', 'shard')}: sample {sample['__key__']!r} "
                            f"has label {label}, outside [0, {num_classes}) of manifest.json")
        if sample["__flip__"]:
            image = image[:, ::-1]
        yield {"__key__": sample["__key__"], "__pos__": sample["__pos__"], "image": image,
               "label": label}


class Chunk(NamedTuple):
    """Up to `batch_size` decoded samples of one worker's stream, as a worker hands them to
    the main process (a NamedTuple: DataLoader's pin_memory copies it field by field)."""

    images: torch.Tensor  # uint8 [b, 3, H, W]
    labels: torch.Tensor  # int64 [b]
    keys: list[str]
    positions: list[int]  # stream position of each sample
    end: int  # stream position after everything the chunk accounts for
    skipped: list[int]  # stream positions of the corrupt samples dropped while filling it
    worker: int


def _chunk(data: Iterator[dict], batch_size: int, worker: int) -> Iterator[Chunk]:
    """Group decoded samples into :class:`Chunk` s of `batch_size` (the last may be partial
    or empty)."""
    samples, skipped, end = [], [], None
    for sample in data:
        end = sample["__pos__"] + 1
        if CORRUPT in sample:
            skipped.append(sample["__pos__"])
            continue
        samples.append(sample)
        if len(samples) == batch_size:
            yield _make_chunk(samples, skipped, end, worker)
            samples, skipped = [], []
    if samples or skipped:
        yield _make_chunk(samples, skipped, end, worker)


def _make_chunk(samples: list[dict], skipped: list[int], end: int, worker: int) -> Chunk:
    height, width = samples[0]["image"].shape[:2] if samples else (0, 0)
    images = np.empty((len(samples), 3, height, width), np.uint8)
    for out, sample in zip(images, samples, strict=True):
        out[...] = sample["image"].transpose(2, 0, 1)  # one strided copy, flip included
    return Chunk(images=torch.from_numpy(images),
                 labels=torch.tensor([s["label"] for s in samples], dtype=torch.int64),
                 keys=[s["__key__"] for s in samples],
                 positions=[s["__pos__"] for s in samples],
                 end=end, skipped=skipped, worker=worker)


annotate = wds.pipelinefilter(_annotate)
skip = wds.pipelinefilter(_skip)
decode = wds.pipelinefilter(_decode)
chunk = wds.pipelinefilter(_chunk)
