"""Several data folders in one run (``data.dirs``): every batch is a fixed mix of all of them.

Set ``i`` supplies ``b_i`` samples of each batch of ``b`` (``b_i`` proportional to its weight,
at least 1, ``sum b_i = b``: :func:`batch_shares`), read by its own shard loader
(data_pipeline.loader) with its own epochs: it reads each of its samples exactly once per
*its* epoch and, when that ends, starts its next one while the others go on. Its labels are
offset by the classes of the sets before it, so the run's class space is the sets' class
spaces side by side: an identity present in two sets is two classes, unless a merge list
(``data.merge``, data_pipeline.merge; ``launch.overlap --between`` finds the pairs) maps the
classes of one person to one label, and the run then has one class per person. One epoch
of the mixture is the largest of the sets' epochs in batches: the set that takes longest to
read is read once, the others once or more.

Default weights are the sets' sample counts: every set then finishes its epoch with the
mixture's (up to rounding). Resume is exact as each set's loader's is: the state is the
mixture's position plus every set's own state, so a resume that falls on one set's epoch
boundary continues that set in its next epoch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from data_pipeline.epoch_batches import ComposedBatches, EpochBatches, concat
from data_pipeline.errors import DataError
from data_pipeline.loader import make_loader
from data_pipeline.merge import MergeList, merged_labels
from data_pipeline.position import MixturePosition


def batch_shares(batch_size: int, weights: Sequence[float]) -> list[int]:
    """Samples of each set per batch: ``batch_size * w_i / sum(w)`` rounded by largest
    remainder, each at least 1 (ValueError when the batch has fewer samples than sets)."""
    if batch_size < len(weights):
        raise ValueError(f"batch_size={batch_size}: fewer samples than the {len(weights)} "
                         "data sets each batch mixes (one sample of each at least)")
    if not weights or min(weights) <= 0:
        raise ValueError(f"weights={list(weights)}: one weight > 0 per data set")
    spare = batch_size - len(weights)  # one sample each first, the rest by weight
    exact = np.asarray(weights, float) / sum(weights) * spare
    shares = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - shares), kind="stable")[:spare - shares.sum()]:
        shares[i] += 1
    return [int(s) + 1 for s in shares]


class MixedLoader(ComposedBatches):
    """Batches (images uint8 [B,3,112,112], labels int64 [B][, flips][, keys]) mixing the folders
    ``data_dirs``; see the module docstring. ``weights`` (default: the sets' sample counts),
    ``excludes`` (one exclusion list or None per folder, in that folder's own labels),
    ``merge`` (a merge list over the folders: its paired classes one label) and the loader
    options (``make_loader``'s; ``num_workers`` is split over the sets by batch share,
    at least one worker each) configure it. Keys, with ``with_keys``, are ``"SET:KEY"``."""

    def __init__(self, data_dirs: Sequence[str | os.PathLike], *, batch_size: int,
                 weights: Sequence[float] | None = None,
                 excludes: Sequence[str | os.PathLike | None] | None = None,
                 merge: MergeList | None = None, num_workers: int = 2,
                 with_keys: bool = False, pin_memory: bool = False, **options):
        excludes = list(excludes) if excludes is not None else [None] * len(data_dirs)
        if weights is not None and len(weights) != len(data_dirs) or \
                len(excludes) != len(data_dirs):
            raise ValueError(f"{len(data_dirs)} data folders but {len(weights or [])} "
                             f"weights and {len(excludes)} exclusion lists")
        # sizes first (the manifests, no tar opened) to split the batch; then the loaders
        from data_pipeline.manifest import read_manifest

        manifests = [read_manifest(d) for d in data_dirs]
        shares = batch_shares(batch_size, weights or [m.num_samples for m in manifests])
        self.sets = [
            make_loader(d, batch_size=b, with_keys=True, exclude=x, pin_memory=pin_memory,
                        num_workers=max(1, round(num_workers * b / batch_size))
                        if num_workers else 0, **options)
            for d, b, x in zip(data_dirs, shares, excludes, strict=True)]
        self.offsets = np.cumsum([0] + [s.num_classes for s in self.sets]).tolist()
        self.people = None if merge is None else torch.from_numpy(
            merged_labels(merge, [s.num_classes for s in self.sets]))  # side by side -> person
        self.num_classes = self.offsets[-1] if merge is None else int(self.people.max()) + 1
        self.batch_size, self.with_keys, self.pin_memory = batch_size, with_keys, pin_memory
        self.deferred_flip = options.get("flip") == "deferred"  # sets yield their flip bits
        self._len = max(len(s) for s in self.sets)
        self._batches, self.epoch = 0, self.sets[0].epoch
        read = sum(len(s) * s.batch_size for s in self.sets) * self.sets[0].world_size
        self.dropped_fraction = 1.0 - read / sum(s.num_samples for s in self.sets)
        self.num_excluded = sum(s.num_excluded for s in self.sets)
        self.num_unindexed = sum(s.num_unindexed for s in self.sets)
        self.reads_url = any(s.reads_url for s in self.sets)

    @property
    def parts(self) -> list[EpochBatches]:
        return self.sets

    def set_epoch(self, epoch: int) -> None:
        """Select the mixture's epoch; a new one restarts the mixture's batch count, while
        every set goes on from where it is in its own epochs."""
        if epoch != self.epoch:
            self.epoch, self._batches = epoch, 0

    def position(self) -> MixturePosition:
        return MixturePosition(epoch=self.epoch, batches=self._batches,
                               sets=tuple(s.position() for s in self.sets))

    def load_state_dict(self, state: dict) -> None:
        self.restore(MixturePosition.from_dict(state))

    def restore(self, position: MixturePosition) -> None:
        if len(position.sets) != len(self.sets):
            raise DataError(f"loader state_dict: saved with {len(position.sets)} data folders, "
                            f"this run has {len(self.sets)} (data.dirs changed)")
        for loader, saved in zip(self.sets, position.sets, strict=True):
            loader.restore(saved)
        self.epoch, self._batches = position.epoch, min(position.batches, self._len)

    def __iter__(self) -> Iterator[tuple]:
        if self._batches >= self._len:  # a finished epoch iterates again from its start
            self._batches = 0
        streams = [_endless(s) for s in self.sets]
        while self._batches < self._len:
            parts = [next(stream) for stream in streams]  # (images, labels[, flips], keys)
            images = concat([p[0] for p in parts], self.pin_memory)
            labels = concat([self._label(p[1], off)
                             for p, off in zip(parts, self.offsets, strict=False)],
                            self.pin_memory)
            batch = (images, labels)
            if self.deferred_flip:
                batch += (concat([p[2] for p in parts], self.pin_memory),)
            self._batches += 1
            if self.with_keys:
                batch += ([f"{i}:{k}" for i, p in enumerate(parts) for k in p[-1]],)
            yield batch

    def _label(self, labels: torch.Tensor, offset: int) -> torch.Tensor:
        """A set's labels in the run's class space: offset, then merged."""
        labels = labels + offset if offset else labels
        if self.people is None:
            return labels
        return self.people[labels].pin_memory() if self.pin_memory else self.people[labels]


def _endless(loader: EpochBatches) -> Iterator[tuple]:
    """A set's batches across its epochs: at the end of one it moves to its next."""
    while True:
        if loader.batches_done >= len(loader):
            loader.set_epoch(loader.epoch + 1)
        yield from loader


def make_mixed_loader(data_dirs: Sequence[str | os.PathLike], **options) -> EpochBatches:
    """The training loader of several converted data folders (``data.dirs``): the keyword
    ``options`` are :class:`MixedLoader`'s."""
    return MixedLoader(data_dirs, **options)
