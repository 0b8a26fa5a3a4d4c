"""Partial FC class sampling (arXiv:2203.15565 Sec. 3): per step and per rank, keep every
positive class of the global batch and fill up with random negatives.

The negatives are a uniformly random subset of the non-positive local classes, drawn as
insightface's ``partial_fc_v2`` draws them: a uniform score per class (fp64, so ties are
rare even at millions of classes), the positives' scores set above every other, and the
``top-k`` rows kept, so the AdaCos ``B`` correction by ``(C - 1) / (S - 1)`` stays valid.
The sample's size is known on the host whenever ``ceil(r * num_local)`` is at least the
batch size (it then bounds the number of positives): the draw then reads nothing from the
device, a fixed sequence of kernels. Otherwise it reads the number of positives once. It
costs ``O(num_local)`` per step (a score per class: 8 bytes per row beside the row's ``D``
weights). The generator is seeded from ``(seed, step, rank)`` only, so a run is
reproducible and never depends on time or pid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from partial_fc.init import derive_seed

if TYPE_CHECKING:
    from partial_fc.batch_stats import GlobalStats

__all__ = ["StepSample", "local_targets", "sample_classes", "sample_size"]


def sample_size(sample_rate: float, num_local: int) -> int:
    """``ceil(r * num_local)``, robust to binary rounding (``0.7 * 10`` is 7, not 8), and at
    least 1 (a rank owning no positive still contributes a class, also at ``r = 0``)."""
    return min(num_local, max(1, math.ceil(round(sample_rate * num_local, 6))))


def local_targets(labels: Tensor, class_start: int, num_local: int) -> Tensor:
    """Global labels ``[N]`` -> this shard's row of each label, ``-1`` where another rank
    owns it."""
    local = labels - class_start
    return torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, -1))


def sample_classes(
    labels: Tensor, class_start: int, num_local: int, sample_rate: float,
    seed: int, step: int, rank: int,
) -> tuple[Tensor | None, Tensor]:
    """Choose this rank's classes for one step.

    Args:
        labels: ``[N_global]`` int64 global labels of the whole (gathered) batch.
        class_start, num_local: this rank's contiguous class range.
        sample_rate: ``r in [0, 1]``; the sample holds ``max(ceil(r * num_local), P)``
            classes, ``P`` the number of distinct positives this rank owns (read from the
            device only when ``ceil(r * num_local) < min(N_global, num_local)``: else
            ``P <= N_global`` cannot exceed it).
        seed, step, rank: seed the negatives' generator (``derive_seed(seed, step, rank)``).

    Returns:
        ``(index, targets)``: ``index`` the sorted local rows kept (``None`` when all rows
        are kept), ``targets`` ``[N_global]`` each label's column in the sampled weight,
        ``-1`` where another rank owns the label.
    """
    targets = local_targets(labels, class_start, num_local)
    size = sample_size(sample_rate, num_local)
    if size < min(labels.numel(), num_local):  # the positives may outnumber it: one read
        size = max(size, _count_positives(targets, num_local))
    if size >= num_local:
        return None, targets
    gen = torch.Generator(device=labels.device).manual_seed(derive_seed(seed, step, rank))
    scores = torch.rand(num_local + 1, generator=gen, device=labels.device, dtype=torch.float64)
    scores.index_fill_(0, _owned_rows(targets, num_local), 2.0)  # above every uniform score
    index = scores[:num_local].topk(size, sorted=False).indices.sort().values
    return index, columns_in(index, targets)


def columns_in(index: Tensor, targets: Tensor) -> Tensor:
    """Each local target row's column in the sorted sampled rows ``index`` (``-1`` stays:
    another rank's class); all rows at once, no label-sized selection."""
    return torch.where(targets >= 0, torch.searchsorted(index, targets), targets)


@dataclass
class StepSample:
    """One class sample shared by the forwards of an optimisation step (gradient
    accumulation; ``PartialFC.begin_step`` draws it): the sampled rows (``None``: all), the
    ``step`` value the forwards use, and how many gathered samples were announced, of which
    ``taken`` have been forwarded. ``statistics``: the step's statistics
    (``partial_fc.batch_stats.GlobalStats``), taken over all its samples when it began; its
    forwards then leave the scale and the margin's EMAs as they are, and report these."""

    index: Tensor | None
    step: int
    samples: int
    taken: int = 0
    statistics: GlobalStats | None = None

    def take(self, y: Tensor, class_start: int, num_local: int) -> Tensor:
        """The columns of the gathered labels ``y`` in the planned sample (``-1``: another
        rank's class), counting them against the announced samples."""
        self.taken += y.shape[0]
        if self.taken > self.samples:
            raise RuntimeError(f"PartialFC: the step's forwards passed {self.taken} samples, "
                               f"more than the {self.samples} begin_step announced")
        targets = local_targets(y, class_start, num_local)
        return targets if self.index is None else columns_in(self.index, targets)


def _owned_rows(targets: Tensor, num_local: int) -> Tensor:
    """``targets`` with another rank's ``-1`` sent to the spare slot ``num_local``: an index
    into ``num_local + 1`` entries, no data-sized selection."""
    return torch.where(targets >= 0, targets, num_local)


def _count_positives(targets: Tensor, num_local: int) -> int:
    """The number of distinct local classes among ``targets`` (reads the host once)."""
    seen = torch.zeros(num_local + 1, dtype=torch.bool, device=targets.device)
    return int(seen.index_fill_(0, _owned_rows(targets, num_local), True)[:num_local].sum())
