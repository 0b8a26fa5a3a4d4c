"""Loader stages: plain generators over sample dicts, curried with `wds.pipelinefilter`.

A worker's stream is  read_pieces -> shuffle (webdataset's buffer, seeded) -> annotate
(stream position and flip bit) -> skip (resume) -> decode -> chunk.  Positions are taken after
the shuffle, so a resumed worker replays the same shuffled stream without decoding and skips
exactly the samples it had handed out. Sample dicts carry `__key__`, `jpg` (bytes), `cls`
(bytes), `__pos__`, `__flip__`; after decode `image` (HWC uint8) replaces `jpg`.
"""

from __future__ import annotations

import random
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import webdataset as wds

from data_pipeline.codec import decode_image
from data_pipeline.errors import CorruptImageError, ShardError
from data_pipeline.manifest import ShardInfo
from data_pipeline.plan import Piece

CORRUPT = "__corrupt__"


def check_shard(path: Path, info: ShardInfo) -> None:
    """ShardError naming the file when it is missing or its size differs from the manifest."""
    if not path.is_file():
        raise ShardError(f"{path}: shard listed in the manifest is missing")
    size = path.stat().st_size
    if size != info.bytes:
        raise ShardError(f"{path}: {size} bytes on disk, manifest says {info.bytes} "
                         "(truncated or rewritten shard)")


def read_piece(path: Path, piece: Piece) -> Iterator[dict]:
    """Samples piece.start..piece.stop-1 of one tar shard; ShardError if the shard ends early."""
    return tar_samples(path, piece.start, piece.stop)


def tar_samples(path: Path, start: int = 0, stop: int | None = None) -> Iterator[dict]:
    """Samples [start, stop) of a tar shard (all from `start` when stop is None) as dicts
    {"__key__": key, ext: bytes, ...}; members of earlier samples are seeked over, not read.
    """
    seen, current = 0, None  # samples started so far; the one being assembled (number seen-1)
    try:
        with tarfile.open(path, mode="r:") as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                if current is None or key != current["__key__"]:
                    if current is not None and seen > start:
                        yield current
                    if seen == stop:
                        return
                    current, seen = {"__key__": key}, seen + 1
                if seen > start and member.isfile():
                    data = tar.extractfile(member).read()
                    if len(data) != member.size:
                        raise ShardError(f"{path}: member {member.name} truncated")
                    current[ext] = data
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ShardError(f"{path}: unreadable tar ({type(exc).__name__}: {exc})") from exc
    if current is not None and seen > start:
        yield current
    if stop is not None and seen < stop:
        raise ShardError(f"{path}: holds {seen} samples, expected at least {stop} "
                         "(truncated shard)")


def read_pieces(pieces: list[Piece], paths: list[Path], infos: list[ShardInfo]) -> Iterator[dict]:
    """Source stage: the raw samples of `pieces` in order; shards are checked before reading."""
    for piece in pieces:
        check_shard(paths[piece.shard], infos[piece.shard])
        yield from read_piece(paths[piece.shard], piece)


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


def _decode(data: Iterator[dict], size: int, decoder: str) -> Iterator[dict]:
    """Decode `jpg` to `image` (flipped if drawn); corrupt samples become CORRUPT markers."""
    for sample in data:
        try:
            if "jpg" not in sample or "cls" not in sample:
                raise CorruptImageError("sample lacks jpg or cls")
            label = int(sample["cls"])
            image = decode_image(sample["jpg"], size, decoder)
        except (CorruptImageError, ValueError):
            yield {CORRUPT: True, "__key__": sample["__key__"], "__pos__": sample["__pos__"]}
            continue
        if sample["__flip__"]:
            image = image[:, ::-1]
        yield {"__key__": sample["__key__"], "__pos__": sample["__pos__"], "image": image,
               "label": label}


def _chunk(data: Iterator[dict], batch_size: int, worker: int) -> Iterator[dict]:
    """Group decoded samples into chunks of `batch_size` (the last may be partial or empty).

    A chunk: images uint8 [b, 3, H, W], labels int64 [b], keys, positions (stream position of
    each sample), end (stream position after everything the chunk accounts for), skipped
    (corrupt samples dropped while filling it), worker.
    """
    samples, skipped, end = [], 0, None
    for sample in data:
        end = sample["__pos__"] + 1
        if CORRUPT in sample:
            skipped += 1
            continue
        samples.append(sample)
        if len(samples) == batch_size:
            yield _make_chunk(samples, skipped, end, worker)
            samples, skipped = [], 0
    if samples or skipped:
        yield _make_chunk(samples, skipped, end, worker)


def _make_chunk(samples: list[dict], skipped: int, end: int, worker: int) -> dict:
    if samples:
        images = np.stack([s["image"] for s in samples]).transpose(0, 3, 1, 2)
        images = torch.from_numpy(np.ascontiguousarray(images))
    else:
        images = torch.empty((0, 3, 0, 0), dtype=torch.uint8)
    return {"images": images,
            "labels": torch.tensor([s["label"] for s in samples], dtype=torch.int64),
            "keys": [s["__key__"] for s in samples],
            "positions": [s["__pos__"] for s in samples],
            "end": end, "skipped": skipped, "worker": worker}


annotate = wds.pipelinefilter(_annotate)
skip = wds.pipelinefilter(_skip)
decode = wds.pipelinefilter(_decode)
chunk = wds.pipelinefilter(_chunk)
