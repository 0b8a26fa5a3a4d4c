"""Partial FC class sampling (arXiv:2203.15565 Sec. 3): per step and per rank, keep every
positive class of the global batch and fill up with random negatives.

The negatives are a uniformly random subset of the non-positive local classes, the same
distribution as insightface's ``partial_fc_v2`` (a uniform score per class, positives forced
to the top, ``top-k``), so the AdaCos ``B`` correction by ``(C - 1) / (S - 1)`` stays valid.
It is drawn without touching all ``num_local`` classes: sequential rejection sampling (iid
uniform rows, each row's first draw kept, positives skipped), vectorised in a few rounds, so
a step costs ``O(S log S)`` for ``S`` sampled classes, not a ``randperm``/``topk`` over the
shard. The generator is seeded from ``(seed, step, rank)`` only, so a run is reproducible and
never depends on time or pid.
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
            classes, ``P`` the number of distinct positives this rank owns.
        seed, step, rank: seed the negatives' generator (``derive_seed(seed, step, rank)``).

    Returns:
        ``(index, targets)``: ``index`` the sorted local rows kept (``None`` when all rows
        are kept), ``targets`` ``[N_global]`` each label's column in the sampled weight,
        ``-1`` where another rank owns the label.
    """
    targets = local_targets(labels, class_start, num_local)
    positives = torch.unique(targets[targets >= 0])
    size = max(sample_size(sample_rate, num_local), positives.numel())
    if size >= num_local:
        return None, targets
    gen = torch.Generator(device=labels.device).manual_seed(derive_seed(seed, step, rank))
    count, free = size - positives.numel(), num_local - positives.numel()
    if 2 * count <= free:
        negatives = _distinct_rows(count, num_local, positives, gen)
    else:  # most rows are kept: draw the (fewer) dropped ones; the complement is as uniform
        keep = torch.ones(num_local, dtype=torch.bool, device=labels.device)
        keep[_distinct_rows(free - count, num_local, positives, gen)] = False
        keep[positives] = False
        negatives = keep.nonzero().squeeze(1)
    index = torch.sort(torch.cat([positives, negatives])).values
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


def _distinct_rows(count: int, num_local: int, excluded: Tensor, gen: torch.Generator) -> Tensor:
    """``count`` distinct rows of ``range(num_local)`` outside the sorted ``excluded``, every
    such subset equally likely: the distinct values of iid uniform draws in first-draw order
    (exclusions skipped) are a uniform random permutation's prefix. Each round draws the
    expected number of draws still needed (coupon collector over all ``num_local`` rows) plus
    slack; O(draws log draws)."""
    device = excluded.device
    free = num_local - excluded.numel()
    chosen = torch.zeros(0, dtype=torch.int64, device=device)
    while chosen.numel() < count:
        unseen = free - chosen.numel()
        expected = num_local * math.log(unseen / max(unseen - (count - chosen.numel()), 0.5))
        draws = torch.randint(num_local, (int(1.1 * expected) + 16,), generator=gen,
                              device=device)
        draws = draws[~torch.isin(draws, excluded)]
        cand = torch.cat([chosen, draws])
        uniq, inverse = torch.unique(cand, return_inverse=True)
        first = torch.full((uniq.numel(),), cand.numel(), dtype=torch.int64, device=device)
        first.scatter_reduce_(0, inverse, torch.arange(cand.numel(), device=device), "amin")
        chosen = cand[first.sort().values]
    return chosen[:count]
