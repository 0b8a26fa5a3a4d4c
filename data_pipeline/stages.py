"""Loader stages: plain generators over sample dicts, curried with `wds.pipelinefilter`.

A worker's stream is  piece_refs (a placeholder per sample) -> shuffle (webdataset's buffer,
seeded) -> annotate (stream position and flip bit; the resumed part skipped) -> fill (the
sample's bytes, from a :class:`ShardReader`) -> decode_chunks (into a batch buffer, mirrored
there, or the flip bits handed on for the consumer to apply on its device). Positions are
taken after the shuffle, so a resumed worker replays the same shuffled stream without reading
and skips exactly the samples it had handed out; its reader fetches only the rest (over a
network: from the byte offset of the first one still wanted). Sample dicts carry `__ref__`,
`__key__`, `jpg` (bytes), `cls` (bytes), `__pos__`, `__flip__`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
import webdataset as wds

from data_pipeline.codec import MAX_PIXELS, Mirror, decode_into
from data_pipeline.epoch_batches import StorageWait
from data_pipeline.epoch_plan import Piece
from data_pipeline.errors import CorruptImageError, DataError
from data_pipeline.manifest import ShardInfo
from data_pipeline.remote import FetchStats
from data_pipeline.shard_index import index_path, indexed_samples, read_index
from data_pipeline.slots import SlotPool
from data_pipeline.tar_reader import check_shard, tar_samples

Wanted = list[tuple[int, list[int]]]  # (shard, ascending positions in it), in reading order


class ShardReader(Protocol):
    """Where a worker's sample bytes come from: a local folder (:class:`LocalShards`) or a
    URL (data_pipeline.remote_shards). ``samples(wanted)`` yields ``((shard, position),
    sample)`` for every position of ``wanted`` in that order, ``sample`` holding ``__key__``,
    ``jpg``, ``cls`` and ``__shard__`` (the shard's name in errors)."""

    num_unindexed: int  # shards without a member index (read by parsing their tar)
    stats: FetchStats  # what this process's reads cost (all zero for a local folder)

    def samples(self, wanted: Wanted) -> Iterator[tuple[tuple[int, int], dict]]: ...


class LocalShards:
    """The shards of a local folder: each checked against the manifest, then read at the
    offsets of its member index (data_pipeline.shard_index), or by parsing its tar where it
    has none, from a memory map."""

    def __init__(self, folder: Path, shards: tuple[ShardInfo, ...]):
        self.paths, self.infos = [folder / s.name for s in shards], shards
        for path, info in zip(self.paths, shards, strict=True):
            check_shard(path, info)
        self.num_unindexed = sum(not index_path(p).is_file() for p in self.paths)
        self.stats = FetchStats()

    def samples(self, wanted: Wanted) -> Iterator[tuple[tuple[int, int], dict]]:
        for shard, positions in wanted:
            path = self.paths[shard]
            check_shard(path, self.infos[shard])
            yield from tagged(shard, positions, path, local_samples(path, positions))


def local_samples(path: Path, positions: list[int]) -> Iterator[dict]:
    """The samples at ``positions`` (ascending) of the local shard ``path``: through its
    member index, else its tar parsed."""
    index = read_index(path)
    if index is not None:
        return indexed_samples(path, index, positions)
    start, stop = positions[0], positions[-1] + 1
    return tar_samples(path, start, stop, set(range(start, stop)).difference(positions),
                       exts=("jpg", "cls"))


def tagged(shard: int, positions: list[int], where: object, samples: Iterator[dict]
           ) -> Iterator[tuple[tuple[int, int], dict]]:
    """``samples`` (one per position) tagged with their ``(shard, position)`` and shard."""
    for position, sample in zip(positions, samples, strict=True):
        sample["__shard__"] = where
        yield (shard, position), sample


def piece_refs(pieces: list[Piece]) -> Iterator[dict]:
    """Source stage: a placeholder per sample of ``pieces`` in order (less each piece's
    ``drop``), ``__ref__`` = (shard, position). The shuffle and the stream positions need only
    these; the bytes are filled in after them (:func:`fill`), so a resumed stream fetches only
    the samples it has not handed out yet."""
    for piece in pieces:
        for position in range(piece.start, piece.stop):
            if position not in piece.drop:
                yield {"__ref__": (piece.shard, position)}


def wanted(pieces: list[Piece], kept: Iterator[dict] | None = None) -> Wanted:
    """What a worker reads: per piece the positions of its samples, all of them, or only those
    of the placeholders ``kept`` (the stream after a resume's skip)."""
    keep = None if kept is None else {sample["__ref__"] for sample in kept}
    out = []
    for piece in pieces:
        positions = [p for p in range(piece.start, piece.stop) if p not in piece.drop
                     and (keep is None or (piece.shard, p) in keep)]
        if positions:
            out.append((piece.shard, positions))
    return out


def _fill(data: Iterator[dict], samples: Iterator[tuple[tuple[int, int], dict]]
          ) -> Iterator[dict]:
    """Each placeholder of ``data`` (in shuffled order) completed with its sample's bytes
    from ``samples`` (in reading order). The samples read but not yet asked for are held
    here: no more than the shuffle buffer holds."""
    held: dict[tuple[int, int], dict] = {}
    for sample in data:
        ref = sample["__ref__"]
        while ref not in held:
            got, raw = next(samples)
            held[got] = raw
        sample.update(held.pop(ref))
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
    storage: StorageWait = StorageWait()  # what the worker's reads cost since its last chunk


def _decode_chunks(data: Iterator[dict], size: int, decoder: str, batch_size: int, worker: int,
                   num_classes: int | None = None, pool: SlotPool | None = None,
                   mirror: bool = True, max_pixels: int = MAX_PIXELS) -> Iterator[Chunk]:
    """Decode `jpg` straight into the rows of a ``[batch_size, size, size, 3]`` buffer
    (mirrored where the flip was drawn, ``codec.decode_into``, unless ``mirror`` is False:
    then the chunk's ``flips`` say which rows its consumer mirrors) and emit it as a
    :class:`Chunk` when full (the last one may be partial, or empty when it only passed over
    corrupt samples). The buffers are ``pool``'s slots in a DataLoader worker, fresh
    tensors otherwise; the stream ends early when the pool's reader has gone.

    Undecodable samples, and those whose header claims more than ``max_pixels``, are dropped
    and their positions recorded in ``Chunk.skipped``. A label
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
            decode_into(sample["jpg"], rows[len(keys)], decoder, mirrored if flip else None,
                        max_pixels)
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
fill = wds.pipelinefilter(_fill)
decode_chunks = wds.pipelinefilter(_decode_chunks)
