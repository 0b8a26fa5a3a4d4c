"""Loader stages: plain generators over sample dicts, curried with `wds.pipelinefilter`.

A worker's stream is  read_pieces -> shuffle (webdataset's buffer, seeded) -> annotate
(stream position and flip bit; the resumed part skipped) -> decode_chunks (into a batch buffer,
mirrored there, or the flip bits handed on for the consumer to apply on its device).
Positions are taken after the shuffle, so a resumed worker replays the same shuffled stream
without decoding and skips exactly the samples it had handed out. Sample dicts carry
`__key__`, `jpg` (bytes), `cls` (bytes), `__pos__`, `__flip__`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
import webdataset as wds

from data_pipeline.codec import Mirror, decode_into
from data_pipeline.epoch_plan import Piece
from data_pipeline.errors import CorruptImageError, DataError
from data_pipeline.manifest import ShardInfo
from data_pipeline.shard_index import indexed_samples, read_index
from data_pipeline.slots import SlotPool
from data_pipeline.tar_reader import check_shard, tar_samples


def read_pieces(pieces: list[Piece], paths: list[Path], infos: list[ShardInfo]) -> Iterator[dict]:
    """Source stage: the raw samples of `pieces` in order (less each piece's `drop`), read at
    the offsets of the shard's index where it has one (data_pipeline.shard_index), else by
    parsing its tar; shards are checked before reading."""
    for piece in pieces:
        path = paths[piece.shard]
        check_shard(path, infos[piece.shard])
        index = read_index(path)
        samples = (tar_samples(path, piece.start, piece.stop, piece.drop, exts=("jpg", "cls"))
                   if index is None else
                   indexed_samples(path, index, piece.start, piece.stop, piece.drop))
        for sample in samples:
            sample["__shard__"] = path
            yield sample


class ShuffleRandom(random.Random):
    """The shuffle buffer's generator: ``randint(a, b)`` draws what :class:`random.Random`'s
    draws (CPython's ``_randbelow_with_getrandbits``: ``n.bit_length()`` random bits, drawn
    again while ``>= n``), in one Python call instead of four. webdataset's shuffle calls it
    once a sample; owning the algorithm also keeps a checkpoint's sample order independent of
    the Python version, which only guarantees ``random()``'s sequence."""

    def randint(self, a: int, b: int) -> int:
        n = b - a + 1
        bits = n.bit_length()
        r = self.getrandbits(bits)
        while r >= n:
            r = self.getrandbits(bits)
        return a + r


def _annotate(data: Iterator[dict], seed: str, flip: bool, skip: int = 0) -> Iterator[dict]:
    """Number the stream (`__pos__`) and draw each sample's flip bit from a seeded generator;
    pass over the first `skip` samples (a resumed stream: their flip bits are still drawn, so
    the rest get the ones of the uninterrupted stream)."""
    rng = random.Random(seed)
    for pos, sample in enumerate(data):
        mirrored = flip and rng.random() < 0.5
        if pos >= skip:
            sample["__pos__"], sample["__flip__"] = pos, mirrored
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
    flips: list[bool]  # each sample's flip bit (applied already unless the flip is deferred)
    positions: list[int]  # stream position of each sample
    end: int  # stream position after everything the chunk accounts for
    skipped: list[int]  # stream positions of the corrupt samples dropped while filling it
    worker: int
    slot: int = -1  # the worker's chunk number, when the images are in its SlotPool


def _decode_chunks(data: Iterator[dict], size: int, decoder: str, batch_size: int, worker: int,
                   num_classes: int | None = None, pool: SlotPool | None = None,
                   mirror: bool = True) -> Iterator[Chunk]:
    """Decode `jpg` straight into the rows of a ``[batch_size, size, size, 3]`` buffer
    (mirrored where the flip was drawn, ``codec.decode_into``, unless ``mirror`` is False:
    then the chunk's ``flips`` say which rows its consumer mirrors) and emit it as a
    :class:`Chunk` when full (the last one may be partial, or empty when it only passed over
    corrupt samples). The buffers are ``pool``'s slots in a DataLoader worker, fresh
    tensors otherwise; the stream ends early when the pool's reader has gone.

    Undecodable samples are dropped and their positions recorded in ``Chunk.skipped``. A label
    outside ``[0, num_classes)`` is not corruption but data that contradicts its manifest: a
    :class:`DataError` naming the shard and the sample's key.
    """
    batch, end = _Filling(batch_size, size, pool, worker, 0), None
    mirrored = Mirror(size) if mirror else None
    for sample in data:
        rows, keys = batch.array, batch.keys
        if rows is None:
            return
        position = sample["__pos__"]
        end = position + 1
        try:
            label, flip = int(sample["cls"]), sample["__flip__"]
            decode_into(sample["jpg"], rows[len(keys)], decoder, mirrored if flip else None)
        except (CorruptImageError, ValueError, KeyError):
            batch.skipped.append(position)
            continue
        if num_classes is not None and not 0 <= label < num_classes:
            raise DataError(f"{sample.get('__shard__', 'shard')}: sample {sample['__key__']!r} "
                            f"has label {label}, outside [0, {num_classes}) of manifest.json")
        batch.labels.append(label)
        batch.flips.append(flip)
        keys.append(sample["__key__"])
        batch.positions.append(position)
        if len(keys) == batch_size:
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
        self.labels, self.keys, self.flips, self.positions = [], [], [], []
        self.skipped: list[int] = []

    def chunk(self, end: int) -> Chunk:
        """The filled rows as a chunk (images: a channels_last view, no copy; or left in the
        pool's slot)."""
        images = None if self.pooled else self.images[:len(self.keys)].permute(0, 3, 1, 2)
        return Chunk(images=images, labels=self.labels, keys=self.keys, flips=self.flips,
                     positions=self.positions, end=end, skipped=self.skipped,
                     worker=self.worker, slot=self.index if self.pooled else -1)


annotate = wds.pipelinefilter(_annotate)
decode_chunks = wds.pipelinefilter(_decode_chunks)
