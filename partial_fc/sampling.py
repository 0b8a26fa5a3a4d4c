"""Partial FC class sampling (arXiv:2203.15565 Sec. 3): per step and per rank, keep every
positive class of the global batch and fill up with random negatives.

The sampler follows insightface's ``partial_fc_v2``: draw a uniform score per local class,
force the positives to the top by giving them score 2, take the ``top-k``, sort, and remap
labels with ``searchsorted``. The generator is seeded from ``(seed, step, rank)`` only, so a
run is reproducible and never depends on time or pid.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from partial_fc.init import derive_seed

__all__ = ["local_targets", "sample_classes", "sample_size"]


def sample_size(sample_rate: float, num_local: int) -> int:
    """``ceil(r * num_local)``, robust to binary rounding (``0.7 * 10`` is 7, not 8), and at
    least 1 for ``r > 0`` (a rank owning no positive still contributes a class)."""
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
        sample_rate: ``r in (0, 1]``; the sample holds ``max(ceil(r * num_local), P)``
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
    score = torch.rand(num_local, generator=gen, device=labels.device)
    score[positives] = 2.0
    index = torch.sort(torch.topk(score, size).indices).values
    owned = targets >= 0
    remapped = torch.searchsorted(index, targets[owned])
    return index, targets.masked_scatter(owned, remapped)
