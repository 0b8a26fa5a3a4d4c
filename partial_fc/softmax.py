"""Class-sharded margin softmax cross-entropy from class-tile statistics (no ``[N, S]`` logits).

Each rank holds the global batch's normalised embeddings ``e [N, D]`` and its ``S`` (sampled)
weight rows; the loss is ``F.cross_entropy`` of the full ``[N, C]`` logits, which no rank
holds, and no rank materialises its ``[N, S]`` part either: the forward reduces per-row
statistics that the head computed with ``class_tile_stats`` (a ``partial_fc.tiles`` back-end)
across the ranks, and the backward recomputes the cosines tile by tile through
``class_tile_grads`` (as Cut Cross-Entropy does, arXiv:2411.09009). The margin ``psi`` is
applied to the ``N`` target cosines only, outside the tiles, so any differentiable ``psi``
works (SphereFace's lambda blend, ArcFace's fallback past ``theta + m > pi``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from partial_fc import distributed as pd
from partial_fc.tiles import TileBackend

__all__ = ["Shard", "margin_softmax_loss"]


class Shard:
    """This rank's part of one step, computed without gradient by the head: the operand
    embeddings ``e`` ``[N, D]``, the weight rows ``w`` ``[S, D]`` (the parameter's rows
    ``index``, or all of them when ``index`` is None), ``inv_norm`` ``[S]``, ``targets``
    ``[N]`` (column or ``-1``), ``owned`` ``[N]`` bool (the rows whose target this shard
    holds) and ``cos_t`` ``[N]`` their target cosines (0 on the other rows), and the tile
    back-end ``tiles``. With ``subcenters = K > 1`` ``w`` holds ``K`` rows per class
    (``partial_fc.subcenters``): ``cos_t`` is the largest of the target's ``K`` and
    ``nearest`` ``[N]`` which centre gave it. Every row is computed and the
    others masked, rather than the owned rows selected: a selection's size depends on the
    labels, and on CUDA learning it makes the host wait for the device."""

    def __init__(self, e: Tensor, w: Tensor, index: Tensor | None, inv_norm: Tensor,
                 targets: Tensor, tiles: TileBackend, subcenters: int = 1) -> None:
        self.e, self.w, self.index, self.inv_norm = e, w, index, inv_norm
        self.targets, self.tiles = targets, tiles
        self.owned = targets >= 0
        k = subcenters  # w: K rows per class (partial_fc.subcenters); the best one counts
        cols = targets.clamp_min(0)
        rows = cols[:, None] * k + torch.arange(k, device=cols.device)  # [N, K]
        cos_k = (e.float()[:, None] * w[rows].float()).sum(dim=2) * inv_norm[rows]
        cos_t, self.nearest = cos_k.max(dim=1)  # nearest: which centre of the target
        self.cos_t = torch.where(self.owned, cos_t, 0.0)

    def stats(self, s: Tensor | float) -> tuple[Tensor, Tensor, Tensor]:
        """``(row_max, row_sum, cos_sum)`` over this shard's non-target columns at scale ``s``."""
        return self.tiles.class_tile_stats(self.e, self.w, self.inv_norm, self.targets, s)


def margin_softmax_loss(
    e: Tensor,
    weight: Tensor,
    shard: Shard,
    row_max: Tensor,
    row_sum: Tensor,
    psi: Callable[[Tensor], Tensor],
    s: Tensor | float,
    process_group: pd.ProcessGroup = None,
    loss_cap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Mean cross-entropy of the global batch over the class shards of ``process_group``.

    Logits: ``z_ik = s * cos_ik`` for ``k != y_i`` and ``z_iy = s * psi(cos_iy)`` (arXiv:1801.07698
    Eq. 3-4); ``loss = mean_i [log sum_k exp(z_ik) - z_iy]`` over all ``N`` rows and all ranks'
    classes. Called by every rank of ``process_group`` (``None`` = WORLD) with the same ``N``.

    Args:
        e: ``[N, D]`` the normalised embeddings (differentiable; ``shard.e`` is their operand).
        weight: the head's parameter ``[num_local, D]``; its gradient is ``dL/dW``: dense when
            ``shard.index`` is None (all rows), else a sparse COO tensor holding the rows
            ``shard.index`` only (autograd accumulates it into ``weight.grad`` as for
            ``nn.Embedding(sparse=True)``; ``partial_fc.optim`` consumes it).
        shard: this rank's rows, targets and tile functions.
        row_max, row_sum: ``shard.stats(s)``'s first two outputs.
        psi: elementwise margin transform of target cosines, ``[n] -> [n]``, differentiable.
        s: the scale, a constant for the step (float or 0-d tensor; no gradient flows to it).
        loss_cap: each row's loss is reported as at most this; the backward is the uncapped
            loss's (insightface's ``DistCrossEntropy`` clamps ``p_target`` at 1e-30 in its
            forward only). ``None``: no cap.

    Returns:
        ``loss`` (0-d, identical on all ranks); ``sum_exp`` ``[N]``,
        ``sum_{k != y_i} exp(z_ik - shift_i)`` over all ranks; ``shift`` ``[N]``, the global
        row max of the logits. Both are replicated and carry no gradient.
    """
    return _MarginSoftmaxLoss.apply(process_group, psi, s, shard, row_max, row_sum, e, weight,
                                    loss_cap)


class _MarginSoftmaxLoss(Function):
    """forward: all-reduce MAX of the row max (a shift that cancels out of the loss), SUM of
    the shifted sum-exp and target logit; backward: ``class_tile_grads`` with

        d loss / d cos_ik = g s p_ik / N  (k != y_i),   g s (p_iy - 1) psi'(cos_iy) / N

    (``p`` the global softmax, ``g`` the incoming loss gradient), ``psi'`` from a small
    autograd call on the 1-D target cosines. Saved: ``[N]`` vectors and the shard only.
    """

    @staticmethod
    def forward(ctx, group, psi, s, shard, row_max, row_sum, e, weight, loss_cap):
        n = shard.e.shape[0]
        owned = shard.owned
        t_logit = psi(shard.cos_t) * s  # [N]; used on the owned rows only
        local_max = torch.where(owned, torch.maximum(row_max, t_logit), row_max)
        shift = pd.all_reduce_max(local_max, group)  # [N]
        partial = torch.stack([row_sum * torch.exp(row_max - shift),
                               torch.where(owned, t_logit - shift, 0.0)])
        sum_exp, target = pd.all_reduce(partial, group)  # [N] each, replicated
        log_total = torch.log(sum_exp + torch.exp(target))
        per_row = log_total - target
        loss = (per_row if loss_cap is None else per_row.clamp_max(loss_cap)).mean()
        ctx.psi, ctx.s, ctx.n, ctx.shard = psi, s, n, shard
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        ctx.save_for_backward(shift + log_total, target - log_total)
        ctx.mark_non_differentiable(sum_exp, shift)
        return loss, sum_exp, shift

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_sum_exp, _grad_shift):
        lse, log_p_target = ctx.saved_tensors
        shard = ctx.shard
        with torch.enable_grad():  # psi' on the 1-D target vector only
            c = shard.cos_t.detach().requires_grad_()
            (slope,) = torch.autograd.grad(ctx.psi(c).sum(), c)
        coef = (grad_loss.float() * ctx.s / ctx.n).expand(ctx.n)
        target_grad = torch.where(shard.owned, (torch.exp(log_p_target) - 1.0) * slope * coef,
                                  0.0)
        grad_e, grad_w = shard.tiles.class_tile_grads(
            shard.e, shard.w, shard.inv_norm, shard.targets, ctx.s, lse, coef.contiguous(),
            target_grad)
        grad_w = grad_w.to(ctx.weight_dtype)
        if shard.index is not None:  # row-sparse (as nn.Embedding(sparse=True)): no dense
            grad_w = torch.sparse_coo_tensor(  # [num_local, D]; index is sorted and unique
                shard.index[None], grad_w, ctx.weight_shape, is_coalesced=True,
                check_invariants=False)
        return None, None, None, None, None, None, grad_e, grad_w, None
