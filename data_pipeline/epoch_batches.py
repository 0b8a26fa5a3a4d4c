"""The batch-source interface the trainer's loop uses (:class:`EpochBatches`), implemented by
the shard loader (data_pipeline.loader), several folders mixed (data_pipeline.mixture) and the
synthetic stream (data_pipeline.synthetic_stream); and :func:`concat`, how a batch is cut
together from slices of others.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from data_pipeline.position import LoaderPosition, saved_for_rank


@dataclass(frozen=True)
class StorageWait:
    """What reading a folder at a URL cost a loader's workers, summed over them: reads
    ``retries``, ``wait_s`` seconds blocked on a read not yet done, and ``stream_s`` seconds
    their streams ran (idle time included, waiting for the trainer to take a chunk). So
    ``wait_s / stream_s`` is the share of the time the loader waited on storage: near 0
    when the store keeps up, whatever else bounds the step."""

    retries: int = 0
    wait_s: float = 0.0
    stream_s: float = 0.0

    def __add__(self, other: StorageWait) -> StorageWait:
        return StorageWait(self.retries + other.retries, self.wait_s + other.wait_s,
                           self.stream_s + other.stream_s)


@runtime_checkable
class EpochBatches(Protocol):
    """A batch source as the trainer uses it (the shard loader, the mixture of folders,
    ``synthetic_stream.SyntheticStream``): everything ``trainer.loop`` calls.

    Iterating yields ``(images uint8 [B, 3, 112, 112], labels int64 [B])`` for the rest of
    the current epoch, and ``flips`` (bool ``[B]``) after the labels when the flip is
    deferred to the consumer (``flip="deferred"``: rows to mirror left-right on its device,
    ``partial_fc.backbones.normalize_images``). ``len``: batches per epoch, the same on
    every rank; ``batches_done``: how many of this epoch's were handed out. ``set_epoch(e)``
    starts epoch ``e`` (the same epoch again keeps a resumed position); ``position()`` /
    ``restore(p)``: where it is, a typed value (data_pipeline.position); ``state_dict()`` /
    ``load_state_dict()``: the same as a checkpoint stores it, a JSON-able dict;
    ``load_saved(states, rank)``: from a checkpoint's positions of all its ranks. ``epoch``;
    ``num_skipped`` (corrupt samples) and ``num_padded`` (samples repeated to fill the last
    batch) in the current epoch; ``num_excluded`` (samples an exclusion list leaves out of
    every epoch); ``num_unindexed`` (shards without a member index, read more slowly);
    ``dropped_fraction`` of each epoch; ``reads_url``: whether it reads a folder at a URL, and
    ``storage`` what that cost since the loader was made (:class:`StorageWait`).
    Implementations subclass it and set ``_len`` and ``_batches`` for the two methods it
    defines.

    ``num_classes``: every label it yields lies in ``[0, num_classes)``; a sample whose label
    does not is refused (a ``DataError`` naming its shard and key) before its batch is
    yielded, never handed on. The trainer's head relies on it and skips its own range check
    (``PartialFC.forward``'s ``trusted_labels``).
    """

    _len: int
    _batches: int
    num_classes: int
    epoch: int
    num_skipped: int
    num_padded: int
    num_excluded: int = 0  # samples an exclusion list leaves out of every epoch
    num_unindexed: int = 0  # shards read by parsing their tar (no member index beside them)
    dropped_fraction: float
    reads_url: bool = False
    storage: StorageWait = StorageWait()

    def __iter__(self) -> Iterator[tuple]: ...

    def set_epoch(self, epoch: int) -> None: ...

    def position(self) -> LoaderPosition: ...

    def restore(self, position: LoaderPosition) -> None: ...

    def load_state_dict(self, state: dict) -> None: ...

    def state_dict(self) -> dict:
        """The position as the checkpoint stores it: a dict of builtins."""
        return self.position().to_dict()

    def load_saved(self, states: list[dict], rank: int) -> None:
        """Resume from a checkpoint's positions, every rank's in rank order (``states``):
        ``rank``'s, or rank 0's when it had fewer ranks (the loader converts it); a
        ``train.global_batch`` loader's saved position gives its first stream's."""
        state = saved_for_rank(states, rank)
        self.load_state_dict(state["streams"][0]["position"] if "streams" in state else state)

    def __len__(self) -> int:
        """Batches per epoch on this rank (identical on every rank)."""
        return self._len

    @property
    def batches_done(self) -> int:
        """Batches of the current epoch already handed out (len(self) = epoch complete)."""
        return self._batches


class ComposedBatches(EpochBatches):
    """A batch source made of others, its ``parts`` (the mixture's folders, a
    ``train.global_batch`` rank's micro-batch streams): its corrupt and padded samples and its
    storage costs are theirs, summed."""

    parts: list[EpochBatches]

    @property
    def storage(self) -> StorageWait:
        return sum((s.storage for s in self.parts), StorageWait())

    @property
    def num_skipped(self) -> int:
        return sum(s.num_skipped for s in self.parts)

    @property
    def num_padded(self) -> int:
        return sum(s.num_padded for s in self.parts)


def concat(parts: list[torch.Tensor], pin_memory: bool) -> torch.Tensor:
    """One batch from slices of chunks (or of several loaders' batches), in page-locked
    memory with ``pin_memory`` (a slice of one pinned chunk already is) so the trainer's
    non_blocking copy to the GPU is async. Images keep their channels_last layout.

    The copy is numpy's: torch's ``cat``/``copy_`` of uint8 runs on its intra-op threads,
    and on a CPU shared with the decoding workers (or other jobs) those threads wait on each
    other: measured 20 ms against numpy's 0.1 ms for a 128-image batch on a loaded machine.
    """
    if len(parts) == 1:
        return parts[0]
    order = (0, 2, 3, 1) if parts[0].dim() == 4 else (0,)  # images: memory order NHWC
    memory = [p.permute(order) for p in parts]
    shape = (sum(len(p) for p in parts), *memory[0].shape[1:])
    out = torch.empty(shape, dtype=parts[0].dtype, pin_memory=pin_memory)
    np.concatenate([m.numpy() for m in memory], out=out.numpy())
    return out.permute(0, 3, 1, 2) if len(order) == 4 else out
