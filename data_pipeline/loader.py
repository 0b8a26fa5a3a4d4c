"""The training loader: equal batches on every rank, each sample at most once per epoch.

Per rank, `num_workers` DataLoader workers (epoch_stream.py) each stream a contiguous slice of
the epoch's plan (epoch_plan.py) through seeded shuffle -> decode (with the flip, or with its bits
handed on: ``flip="deferred"``) and emit chunks of up to `batch_size`, decoded into
shared-memory slots (slots.py); the main process copies them out, re-cuts them into exactly
`batch_size` batches (uint8, channels_last strides) and stops after `len(loader)` batches,
which is the same number on every rank (computed from the manifest, less the samples of an
exclusion list, `exclude`). Samples beyond that (fewer than world_size + batch_size per
rank) are the epoch's drop, reported as `dropped_fraction`. Corrupt samples are skipped and
counted in `num_skipped` (per epoch: the same files fail every epoch); they are replaced by
the rank's spare samples, and only if those run out is the last batch filled with repeats of
the previous one (counted in `num_padded`; after a resume inside that padded tail, repeats
of the epoch's first decodable chunk).

Resume (`position` / `restore`, or `state_dict` / `load_state_dict` at the checkpoint
boundary, data_pipeline.position): the state is the epoch, the batches handed out and each
worker's stream position, under the plan (`plan_key`). Restored with the same seed, world
size, workers, batch size, shuffle settings and data, the remaining samples of the epoch are
exactly the ones not yet handed out and each worker replays its own stream exactly; only the
interleaving of the workers' remaining chunks into batches can differ from an uninterrupted
run. A state saved on another rank (same settings) is converted by replaying the chunk
schedule: exact unless corrupt samples were skipped before the save. With different settings
the resume is approximate: every worker skips the same fraction of its new stream as was
consumed, so a few samples of that epoch may be repeated or missed.
"""

from __future__ import annotations

import bisect
import math
import os
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from data_pipeline import epoch_plan, stages
from data_pipeline.codec import MAX_PIXELS, resolve_decoder
from data_pipeline.epoch_batches import EpochBatches, StorageWait, concat
from data_pipeline.epoch_stream import IMAGE_SIZE, EpochStream, as_is, start_worker
from data_pipeline.errors import DataError
from data_pipeline.exclusion import excluded_positions, read_exclusions
from data_pipeline.manifest import read_manifest
from data_pipeline.position import ShardPlan, ShardPosition
from data_pipeline.remote import open_folder
from data_pipeline.remote_shards import RemoteShards, Streaming
from data_pipeline.slots import SlotPool


@dataclass
class _Pending:
    """A worker's chunk not yet fully handed out: the main process's bookkeeping beside it."""

    chunk: stages.Chunk
    offset: int = 0  # its first sample not handed out
    counted: int = 0  # its corrupt samples already in `num_skipped`



class _ShardLoader(EpochBatches):
    """The training loader for a converted data folder (a local path or a URL,
    data_pipeline.remote): an iterable over (images uint8
    [B,3,112,112], labels int64 [B][, flips bool [B]][, keys list[str]]); see the module
    docstring for the guarantees. Built by `make_loader`, the one public name.

    rank/world_size: this process's data-parallel position (pass them explicitly; the
        trainer reads them from its process group). batch_size is per rank.
    shuffle=False reads shards in order with no sample shuffle (evaluation, debugging).
    flip: True mirrors each image left-right with probability 1/2 (a seeded draw per stream
        position) in the worker; "deferred" draws the same bits but leaves the images as
        decoded and yields the bits (``flips``) after the labels, for the consumer to apply
        on its device (``partial_fc.backbones.normalize_images(images, flips)``: the trainer
        does, where it costs nothing on a GPU and frees the worker's CPU from it); False
        never mirrors.
    decoder: "auto" (simplejpeg if installed, else PIL), "simplejpeg" or "pil".
    max_pixels: a sample whose image header claims more pixels is skipped and counted, before
        it is decoded (``data.max_pixels``; at least 112 x 112).
    pin_memory: batches in page-locked memory, for asynchronous copies to a CUDA device
        (needs CUDA; the trainer sets it when it trains on one).
    exclude: an exclusion list (data_pipeline.exclusion) of this folder's sample keys and
        labels: those samples are left out of every epoch before it is planned (each kept
        sample is still read once per epoch), and counted in `num_excluded`.
    streaming: how a folder at a URL is read (data_pipeline.remote_shards.Streaming: request
        size, requests in flight, retries, the node-local cache); unused for a local folder.
    """

    def __init__(self, data_dir: str | os.PathLike, *, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, epoch: int = 0, num_workers: int = 2,
                 flip: bool | str = True, with_keys: bool = False, shuffle: bool = True,
                 shuffle_buffer: int = 1000, decoder: str = "auto", prefetch_factor: int = 2,
                 pin_memory: bool = False, exclude: str | os.PathLike | None = None,
                 streaming: Streaming | None = None, max_pixels: int = MAX_PIXELS):
        if batch_size < 1 or num_workers < 0 or shuffle_buffer < 0 or world_size < 1:
            raise ValueError(f"batch_size={batch_size}, num_workers={num_workers}, "
                             f"shuffle_buffer={shuffle_buffer}, world_size={world_size}: "
                             "batch_size and world_size must be >= 1, the others >= 0")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} outside [0, world_size={world_size})")
        if flip not in (True, False, "deferred"):
            raise ValueError(f"flip={flip!r}: choose True, False or 'deferred'")
        streaming = streaming or Streaming()
        self.folder = open_folder(data_dir, streaming.retry)
        self.data_dir = self.folder if isinstance(self.folder, Path) else self.folder.shown
        self.manifest = read_manifest(self.folder)
        self.num_classes = self.manifest.num_classes  # each label is checked against it
        self.reader = (stages.LocalShards(self.folder, self.manifest.shards)
                       if isinstance(self.folder, Path) else
                       RemoteShards(self.folder, self.manifest.shards, streaming))
        self.num_unindexed = self.reader.num_unindexed
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.batch_size, self.num_workers = batch_size, num_workers
        self.flip, self.with_keys, self.shuffle = flip, with_keys, shuffle
        self.shuffle_buffer, self.prefetch_factor = shuffle_buffer, prefetch_factor
        self.pin_memory = pin_memory
        self.decoder, self.max_pixels = resolve_decoder(decoder), max_pixels
        self.excluded, self.exclusion_key = self._exclusions(exclude)
        self.kept_counts = [c - len(e) for c, e in zip(self.manifest.shard_counts,
                                                        self.excluded, strict=True)]
        total = self.num_samples = sum(self.kept_counts)
        self.num_excluded = self.manifest.num_samples - total
        self._len = epoch_plan.batches_per_rank(total, world_size, batch_size)
        if self._len == 0:
            raise DataError(f"{self.data_dir}: {total} samples" + (
                f" ({self.num_excluded} excluded by {exclude})" if self.num_excluded else "")
                + f" cannot fill one batch of {batch_size} on each of {world_size} ranks")
        self.dropped_fraction = 1.0 - self._len * batch_size * world_size / total
        self.epoch = epoch
        self._batches = 0
        self._positions = [0] * max(1, num_workers)
        self.num_skipped = 0
        self.num_padded = 0
        self.reads_url = not isinstance(self.folder, Path)
        self.storage = StorageWait()

    def _exclusions(self, path: str | os.PathLike | None) -> tuple[list[np.ndarray], str]:
        """Per shard the positions ``path``'s list leaves out, and a fingerprint of them
        for the plan key ("" when nothing is excluded)."""
        if path is None:
            return [np.empty(0, np.int64) for _ in self.manifest.shards], ""
        if not isinstance(self.folder, Path):
            raise DataError(f"{path}: exclusion lists apply to local data folders; "
                            f"{self.data_dir} is a URL (copy the set to a local folder to "
                            "exclude samples of it)")
        exclusions = read_exclusions(path)
        wrong = sorted(c for c in exclusions.classes if c >= self.manifest.num_classes)
        if wrong:
            raise DataError(f"{path}: class {wrong[0]} outside [0, "
                            f"{self.manifest.num_classes}) of {self.data_dir} (an exclusion "
                            "list names labels of the data folder it was made for)")
        excluded = excluded_positions([self.folder / s.name for s in self.manifest.shards],
                                      exclusions)
        digest = zlib.crc32(b"".join(e.tobytes() + b"/" for e in excluded))
        return excluded, f"{sum(map(len, excluded))}-{digest:08x}"

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate; changing it restarts at the epoch's first batch (and
        the count of skipped samples).

        Setting the current epoch again keeps the position (so set_epoch after
        load_state_dict resumes mid-epoch).
        """
        if epoch != self.epoch:
            self.epoch = epoch
            self._batches, self._positions = 0, [0] * len(self._positions)
            self.num_skipped = 0

    def plan_key(self) -> ShardPlan:
        """Everything that fixes the epoch's sample order (saved with the position)."""
        return ShardPlan(seed=self.seed, world_size=self.world_size,
                         num_workers=len(self._positions), batch_size=self.batch_size,
                         num_samples=self.num_samples, shuffle=self.shuffle,
                         shuffle_buffer=self.shuffle_buffer, excluded=self.exclusion_key)

    def position(self) -> ShardPosition:
        return ShardPosition(epoch=self.epoch, batches=self._batches, rank=self.rank,
                             worker_positions=tuple(self._positions),
                             num_skipped=self.num_skipped, num_padded=self.num_padded,
                             plan=self.plan_key())

    def load_state_dict(self, state: dict) -> None:
        self.restore(ShardPosition.from_dict(state))

    def restore(self, position: ShardPosition) -> None:
        """Go back to ``position`` (see the module docstring for exact vs approximate)."""
        self.epoch = position.epoch
        self.num_skipped, self.num_padded = position.num_skipped, position.num_padded
        sizes = epoch_plan.worker_sizes(self.num_samples, self.world_size,
                                        len(self._positions))
        positions = list(position.worker_positions)
        if position.plan == self.plan_key():
            self._batches = position.batches
            if position.rank != self.rank:
                positions = epoch_plan.consumed_positions(sizes, self.batch_size,
                                                    position.batches * self.batch_size)
        else:
            old_len = position.plan.batches_per_rank
            fraction = min(1.0, position.batches / old_len) if old_len else 0.0
            self._batches = min(self._len, math.ceil(fraction * self._len))
            positions = [math.floor(fraction * n) for n in sizes]
        self._positions = positions

    def __iter__(self):
        if self._batches >= self._len:  # a finished epoch iterates again from its start
            self._batches, self._positions = 0, [0] * len(self._positions)
            self.num_skipped = 0
        stream = EpochStream(self, self.epoch, list(self._positions))
        workers = self.num_workers
        if workers:  # in flight per worker: prefetch_factor chunks, one being decoded
            stream.pool = SlotPool(workers, self.prefetch_factor + 2, self.batch_size,
                                   IMAGE_SIZE)
        batches = DataLoader(stream, batch_size=None, num_workers=workers,
                             prefetch_factor=self.prefetch_factor if workers else None,
                             collate_fn=as_is, worker_init_fn=start_worker,
                             generator=torch.Generator().manual_seed(self.seed))
        try:
            yield from self._batches_of(batches, stream.pool)
        finally:
            if stream.pool is not None:
                stream.pool.close()

    def _received(self, chunk: stages.Chunk, pool: SlotPool | None) -> stages.Chunk:
        """A chunk as the main process keeps it: images out of the worker's pool slot, labels
        and flip bits tensors (all in page-locked memory with ``pin_memory``)."""
        images = chunk.images
        if pool is not None:
            images = pool.receive(chunk.worker, chunk.slot, len(chunk.keys), self.pin_memory)
        elif self.pin_memory:
            images = images.pin_memory()
        labels = torch.tensor(chunk.labels, dtype=torch.int64)
        flips = torch.tensor(chunk.flips, dtype=torch.bool)
        if self.pin_memory:
            labels, flips = labels.pin_memory(), flips.pin_memory()
        return chunk._replace(images=images, labels=labels, flips=flips)

    def _batches_of(self, batches, pool: SlotPool | None):
        pending: deque[_Pending] = deque()
        buffered, last = 0, None
        for chunk in batches:
            self.storage += chunk.storage
            pending.append(_Pending(self._received(chunk, pool)))
            buffered += len(chunk.keys)
            while buffered >= self.batch_size and self._batches < self._len:
                last = self._take(pending, self.batch_size)
                buffered -= self.batch_size
                yield self._emit(last)
            if self._batches >= self._len:
                return
        while self._batches < self._len:  # corrupt samples ate the spare ones: pad
            if buffered == 0 and last is None:  # resumed past the last decodable sample
                last = self._first_decodable()
            parts = self._take(pending, buffered) if buffered else None
            for entry in pending:  # only all-corrupt chunks are left: passed over
                self._advance(entry, entry.chunk.end)
            pending.clear()
            buffered = 0
            last = _pad(parts, last, self.batch_size)
            self.num_padded += self.batch_size - (len(parts[-1]) if parts else 0)
            yield self._emit(last)

    def _advance(self, entry: _Pending, position: int) -> None:
        """Move the chunk's worker to stream `position`; count the corrupt samples passed (so
        `num_skipped` matches the saved positions: a resume never counts one twice)."""
        self._positions[entry.chunk.worker] = position
        passed = bisect.bisect_left(entry.chunk.skipped, position)
        self.num_skipped += passed - entry.counted
        entry.counted = passed

    def _first_decodable(self) -> tuple:
        """Pad source after a resume into the padded tail of an epoch (the batch an
        uninterrupted run repeats is gone): the epoch's first decodable chunk, read in-process."""
        stream = EpochStream(self, self.epoch, [0] * len(self._positions))
        for worker in range(len(self._positions)):
            for chunk in stream.chunks(worker):
                if chunk.keys:
                    chunk = self._received(chunk, None)
                    return chunk.images, chunk.labels, chunk.flips, chunk.keys
        raise DataError(f"{self.data_dir}: no decodable sample in rank {self.rank}'s "
                        f"share of epoch {self.epoch}")

    def _emit(self, batch: tuple) -> tuple:
        """``(images, labels, flips, keys)`` as the loader's options ask for it."""
        self._batches += 1
        images, labels, flips, keys = batch
        return ((images, labels) + ((flips,) if self.flip == "deferred" else ())
                + ((keys,) if self.with_keys else ()))

    def _take(self, pending: deque[_Pending], count: int) -> tuple:
        """Cut `count` samples off the front of the pending chunks; advance worker positions.
        Returns ``(images, labels, flips, keys)``."""
        images, labels, flips, keys = [], [], [], []
        while count > 0 or (pending and not pending[0].chunk.keys):
            entry = pending[0]
            chunk, offset = entry.chunk, entry.offset
            n = min(count, len(chunk.keys) - offset)
            if n > 0:
                images.append(chunk.images[offset:offset + n])
                labels.append(chunk.labels[offset:offset + n])
                flips.append(chunk.flips[offset:offset + n])
                keys.extend(chunk.keys[offset:offset + n])
                self._advance(entry, chunk.positions[offset + n - 1] + 1)
            count -= n
            if offset + n == len(chunk.keys):
                self._advance(entry, chunk.end)
                pending.popleft()
            else:
                entry.offset = offset + n
        return (*(concat(parts, self.pin_memory) for parts in (images, labels, flips)), keys)



def _pad(parts: tuple | None, last: tuple | None, batch_size: int) -> tuple:
    """A full batch ``(images, labels, flips, keys)`` from the leftover `parts` plus repeats
    of `last` (or of parts itself)."""
    source = last if last is not None else parts
    have = len(parts[-1]) if parts else 0
    idx = torch.arange(batch_size - have) % len(source[-1])
    tensors = [t[idx] for t in source[:-1]]
    keys = [source[-1][i] for i in idx.tolist()]
    if parts:
        tensors = [torch.cat([p, t]) for p, t in zip(parts[:-1], tensors, strict=True)]
        keys = parts[-1] + keys
    return (*tensors, keys)


def make_loader(data_dir: str | os.PathLike, **options) -> EpochBatches:
    """The training loader of a converted data folder (data_pipeline's loader factory): the
    keyword ``options`` are :class:`_ShardLoader`'s, declared there once."""
    return _ShardLoader(data_dir, **options)
