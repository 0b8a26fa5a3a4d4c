"""ArcFace's auxiliary losses (arXiv:1801.07698 Sec. 3, Eq. 5-7, compared in its Table 2),
added with weights to any margin's softmax loss, exactly over the global batch and all shards.

- Intra-Loss (Eq. 5): ``+ w_intra * mean_i theta_{y_i} / pi``, the target angle, a function of
  the target cosine only: the softmax's ``extra`` term (``partial_fc.softmax.TargetTerms``),
  so it runs on either class-tile back-end.
- Inter-Loss (Eq. 6): ``- w_inter / (pi N (n - 1)) sum_i sum_{j != y_i} arccos(W_hat_{y_i} .
  W_hat_j)``: each sample's target centre against every other centre of every shard (the
  sampled ones at ``head.sample_rate < 1``, ``n - 1`` then the sampled negatives). The target
  centres are all-reduced (each has one owner), each rank sums its own columns in class chunks
  and the partial sums and centre gradients are all-reduced; the result enters the softmax as
  a ``RowTerm`` (value and gradient w.r.t. this rank's rows).
- Triplet-Loss (Eq. 7): ``+ w_triplet * mean_i [theta(x_i, x_i^+) + m - theta(x_i, x_i^-)]_+``
  in angle, with ``m = triplet_margin`` (0.35). The paper does not say how triplets are chosen;
  here each anchor takes its hardest positive and negative in the global batch (batch-hard,
  Hermans et al. arXiv:1703.07737), averaged over the anchors that have both. Each rank
  scores its own anchors against the gathered batch; the head all-reduces the shares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from partial_fc import distributed as dist_ops
from partial_fc.margins.base import acos
from partial_fc.softmax import RowTerm, Shard

__all__ = ["AuxLosses", "inter_loss", "intra_loss", "triplet_loss"]


@dataclass(frozen=True)
class AuxLosses:
    """The weights of the three terms (0 = off) and the triplet margin (radians)."""

    intra: float = 0.0
    inter: float = 0.0
    triplet: float = 0.0
    triplet_margin: float = 0.35

    def __post_init__(self) -> None:
        for key in ("intra", "inter", "triplet", "triplet_margin"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"loss.{key}={value!r}: must be a finite number >= 0")


def intra_loss(weight: float):
    """Eq. 5's per-sample term of target cosines ``c``: ``weight * theta / pi``."""
    return lambda c: weight * acos(c.float()) / math.pi


def inter_loss(shard: Shard, negatives: Tensor, weight: float, chunk: int,
               group: dist_ops.ProcessGroup) -> RowTerm:
    """Eq. 6 over the global batch (collective): the value and its gradient w.r.t.
    ``shard.w``. ``negatives``: the sampled non-target classes per row over all ranks
    (``S - 1``, 0-d); ``chunk``: class columns per ``[N, chunk]`` block."""
    n = shard.e.shape[0]
    with torch.no_grad():
        w_hat = shard.w.float() * shard.inv_norm[:, None]
        cols = shard.targets.clamp_min(0)
        centres = dist_ops.all_reduce(torch.where(shard.owned[:, None], w_hat[cols], 0.0), group)
    t = centres.detach().requires_grad_()
    w = shard.w.detach().float().requires_grad_()
    total = torch.zeros((), dtype=torch.float64, device=w.device)
    grad_t, grad_w = torch.zeros_like(t), torch.zeros_like(w)
    rows = torch.arange(n, device=w.device)
    for a in range(0, w.shape[0], chunk):
        b = min(a + chunk, w.shape[0])
        with torch.enable_grad():
            cos = t @ F.normalize(w[a:b], dim=1, eps=1e-12).t()
            keep = torch.ones_like(cos, dtype=torch.bool)
            hit = (shard.targets >= a) & (shard.targets < b)
            keep[rows[hit], shard.targets[hit] - a] = False
            part = torch.where(keep, acos(cos), 0.0).sum()
            g_t, g_w = torch.autograd.grad(part, [t, w])
        total += part.detach().double()
        grad_t += g_t
        grad_w += g_w
    total, grad_t = dist_ops.all_reduce(total, group), dist_ops.all_reduce(grad_t, group)
    # the centres' gradient reaches their owners' rows through the normalisation
    owned_t = w_hat[cols]
    radial = grad_t - owned_t * (owned_t * grad_t).sum(dim=1, keepdim=True)
    radial = torch.where(shard.owned[:, None], radial * shard.inv_norm[cols][:, None], 0.0)
    grad_w.index_add_(0, cols, radial)
    factor = -weight / (math.pi * n * negatives.double())
    return RowTerm(value=(factor * total).float(), grad_w=grad_w * factor.float())


def triplet_loss(e: Tensor, labels: Tensor, rows: slice, margin: float) -> Tensor:
    """Eq. 7, batch-hard, of the gathered normalised embeddings ``e`` ``[N, D]`` and labels
    ``[N]``: this rank's share (its anchors ``rows``) of the global mean, unweighted; the
    shares of all ranks sum to the loss."""
    same = labels[rows, None] == labels[None, :]
    own = torch.arange(rows.start, rows.stop, device=e.device)
    self_pair = own[:, None] == torch.arange(e.shape[0], device=e.device)[None, :]
    pos, neg = same & ~self_pair, ~same
    theta = acos(e[rows] @ e.t())
    hardest_pos = torch.where(pos, theta, -math.inf).amax(dim=1)
    hardest_neg = torch.where(neg, theta, math.inf).amin(dim=1)
    valid = pos.any(dim=1) & neg.any(dim=1)
    hinge = torch.where(valid, (hardest_pos + margin - hardest_neg).clamp_min(0.0), 0.0)
    all_same = labels[:, None] == labels[None, :]
    has_pos = (all_same.sum(dim=1) > 1) & ~all_same.all(dim=1)  # every rank's anchors
    count = has_pos.sum().clamp_min(1)
    return hinge.sum() / count
