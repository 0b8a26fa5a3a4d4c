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
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from partial_fc import distributed as pd
from partial_fc.nontarget import NonTarget
from partial_fc.tiles import ReferenceTiles, TileBackend
from partial_fc.tiles.filtered import Skip, operand_dtype, skip_bounds

__all__ = ["RowTerm", "Shard", "TargetTerms", "margin_softmax_loss"]


@dataclass(frozen=True)
class TargetTerms:
    """What the loss does with the ``N`` target cosines ``c``: the target logit's cosine
    ``psi(c, aux)`` (``aux``: a differentiable per-sample input, e.g. MagFace's norms, whose
    gradient the loss returns; or None) and, optionally, ``extra(c)``, a per-sample term whose
    batch mean is added to the loss (ArcFace's Intra-Loss). Both elementwise, differentiable."""

    psi: Callable[[Tensor, Tensor | None], Tensor]
    aux: Tensor | None = None
    extra: Callable[[Tensor], Tensor] | None = None


@dataclass(frozen=True)
class RowTerm:
    """A loss term of this rank's weight rows computed beforehand (ArcFace's Inter-Loss):
    its value (0-d, replicated) and its gradient w.r.t. ``Shard.w`` (``[S, D]`` fp32)."""

    value: Tensor
    grad_w: Tensor


class Shard:
    """This rank's part of one step, computed without gradient by the head: the operand
    embeddings ``e`` ``[N, D]``, the weight rows ``w`` ``[S, D]`` (the parameter's rows
    ``index``, or all of them when ``index`` is None), ``inv_norm`` ``[S]``, ``targets``
    ``[N]`` (column or ``-1``), ``owned`` ``[N]`` bool (the rows whose target this shard
    holds) and ``cos_t`` ``[N]`` their target cosines (0 on the other rows), and the tile
    back-end ``tiles`` with the step's non-target transform ``nontarget`` (None: identity;
    ``partial_fc.nontarget``, which both back-ends apply). ``skip_classes``: the head's
    ``num_classes`` when its backward is the kernels' filtered one (``partial_fc.tiles.
    filtered``; it applies only to the Triton kernels and to plain non-target logits), else
    None (exact).
    With ``subcenters = K > 1`` ``w`` holds ``K`` rows per class (``partial_fc.subcenters``):
    ``cos_t`` is the largest of the target's ``K`` and ``nearest`` ``[N]`` which centre gave
    it. Every row is computed and the
    others masked, rather than the owned rows selected: a selection's size depends on the
    labels, and on CUDA learning it makes the host wait for the device."""

    def __init__(self, e: Tensor, w: Tensor, index: Tensor | None, inv_norm: Tensor,
                 targets: Tensor, tiles: TileBackend, subcenters: int = 1,
                 nontarget: NonTarget | None = None, skip_classes: int | None = None) -> None:
        self.e, self.w, self.index, self.inv_norm = e, w, index, inv_norm
        self.targets, self.tiles, self.nontarget = targets, tiles, nontarget
        self.skip_classes = skip_classes
        self.owned = targets >= 0
        k = subcenters  # w: K rows per class (partial_fc.subcenters); the best one counts
        cols = targets.clamp_min(0)
        rows = cols[:, None] * k + torch.arange(k, device=cols.device)  # [N, K]
        cos_k = (e.float()[:, None] * w[rows].float()).sum(dim=2) * inv_norm[rows]
        cos_t, self.nearest = cos_k.max(dim=1)  # nearest: which centre of the target
        self.cos_t = torch.where(self.owned, cos_t, 0.0)

    def stats(self, s: Tensor | float) -> tuple[Tensor, Tensor, Tensor]:
        """``(row_max, row_sum, cos_sum)`` over this shard's non-target columns at scale ``s``."""
        return self.tiles.class_tile_stats(self.e, self.w, self.inv_norm, self.targets, s,
                                           **self._nontarget())

    def grads(self, s: Tensor | float, lse: Tensor, coef: Tensor, target_grad: Tensor,
              log_p_target: Tensor) -> tuple[Tensor, Tensor]:
        """``class_tile_grads`` of this shard (see ``partial_fc.tiles``); ``log_p_target``
        ``[N]`` (the global ``log p_iy``) gives the filtered backward its skip bounds."""
        extra = self._nontarget()
        if (self.skip_classes is not None and self.nontarget is None
                and not isinstance(self.tiles, ReferenceTiles)):
            extra["skip"] = Skip(skip_bounds(coef, log_p_target, self.skip_classes,
                                             operand_dtype(self.e.dtype, self.w.dtype)))
        return self.tiles.class_tile_grads(self.e, self.w, self.inv_norm, self.targets, s, lse,
                                           coef, target_grad, **extra)

    def _nontarget(self) -> dict[str, NonTarget]:
        return {} if self.nontarget is None else {"nontarget": self.nontarget}


def margin_softmax_loss(
    e: Tensor,
    weight: Tensor,
    shard: Shard,
    row_max: Tensor,
    row_sum: Tensor,
    target: TargetTerms,
    s: Tensor | float,
    process_group: pd.ProcessGroup = None,
    row_term: RowTerm | None = None,
    loss_cap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Mean cross-entropy of the global batch over the class shards of ``process_group``.

    Logits: ``z_ik = s * f_i(cos_ik)`` for ``k != y_i`` (``f`` the shard's non-target
    transform, else the identity) and ``z_iy = s * psi(cos_iy)`` (arXiv:1801.07698 Eq. 3-4);
    ``loss = mean_i [log sum_k exp(z_ik) - z_iy + extra(cos_iy)] + row_term`` over all ``N`` rows
    and all ranks' classes. Called by every rank of ``process_group`` (``None`` = WORLD) with
    the same ``N``.

    Args:
        e: ``[N, D]`` the normalised embeddings (differentiable; ``shard.e`` is their operand).
        weight: the head's parameter ``[num_local, D]``; its gradient is ``dL/dW``: dense when
            ``shard.index`` is None (all rows), else a sparse COO tensor holding the rows
            ``shard.index`` only (autograd accumulates it into ``weight.grad`` as for
            ``nn.Embedding(sparse=True)``; ``partial_fc.optim`` consumes it).
        shard: this rank's rows, targets and tile functions.
        row_max, row_sum: ``shard.stats(s)``'s first two outputs.
        target: the target transform ``psi`` (elementwise, ``[N] -> [N]``), its per-sample input
            and the optional per-sample extra term (:class:`TargetTerms`).
        s: the scale, a constant for the step (float or 0-d tensor; no gradient flows to it).
        row_term: a term of this rank's rows with its gradient (:class:`RowTerm`), or None.
        loss_cap: each row's softmax loss is reported as at most this; the backward is the
            uncapped loss's (insightface's ``DistCrossEntropy`` clamps ``p_target`` at 1e-30 in
            its forward only). ``None``: no cap.

    Returns:
        ``loss`` (0-d, identical on all ranks); ``sum_exp`` ``[N]``,
        ``sum_{k != y_i} exp(z_ik - shift_i)`` over all ranks; ``shift`` ``[N]``, the global
        row max of the logits. Both are replicated and carry no gradient.
    """
    return _MarginSoftmaxLoss.apply(process_group, target, s, shard, row_max, row_sum, row_term,
                                    loss_cap, e, weight, target.aux)


class _MarginSoftmaxLoss(Function):
    """forward: all-reduce MAX of the row max (a shift that cancels out of the loss), SUM of
    the shifted sum-exp, the target logit and the extra term; backward: ``class_tile_grads``
    with

        d loss / d cos_ik = g s p_ik f_i'(cos_ik) / N  (k != y_i),
        d loss / d cos_iy = g [s (p_iy - 1) psi'(cos_iy) + extra'(cos_iy)] / N

    (``p`` the global softmax, ``g`` the incoming loss gradient), ``psi'`` and ``extra'`` (and
    ``d psi / d aux``, which is ``aux``'s gradient times ``g s (p_iy - 1) / N``) from a small
    autograd call on the 1-D target vectors. Saved: ``[N]`` vectors and the shard only.
    """

    @staticmethod
    def forward(ctx, group, target, s, shard, row_max, row_sum, row_term, loss_cap, e, weight,
                aux):
        n = shard.e.shape[0]
        owned = shard.owned
        aux_value = None if aux is None else aux.detach()
        t_logit = target.psi(shard.cos_t, aux_value) * s  # [N]; used on the owned rows only
        local_max = torch.where(owned, torch.maximum(row_max, t_logit), row_max)
        shift = pd.all_reduce_max(local_max, group)  # [N]
        parts = [row_sum * torch.exp(row_max - shift), torch.where(owned, t_logit - shift, 0.0)]
        if target.extra is not None:
            parts.append(torch.where(owned, target.extra(shard.cos_t), 0.0))
        sums = pd.all_reduce(torch.stack(parts), group)  # [2 or 3, N], replicated
        sum_exp, target_logit = sums[0], sums[1]
        log_total = torch.log(sum_exp + torch.exp(target_logit))
        per_row = log_total - target_logit
        loss = (per_row if loss_cap is None else per_row.clamp_max(loss_cap)).mean()
        if target.extra is not None:
            loss = loss + sums[2].mean()
        if row_term is not None:
            loss = loss + row_term.value
        ctx.target, ctx.s, ctx.n, ctx.shard, ctx.row_term = target, s, n, shard, row_term
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        ctx.has_aux = aux is not None
        ctx.save_for_backward(shift + log_total, target_logit - log_total, aux_value)
        ctx.mark_non_differentiable(sum_exp, shift)
        return loss, sum_exp, shift

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_sum_exp, _grad_shift):
        lse, log_p_target, aux = ctx.saved_tensors
        shard, target = ctx.shard, ctx.target
        slope, aux_slope, extra_slope = _target_slopes(target, shard.cos_t, aux)
        g = grad_loss.float()
        coef = (g * ctx.s / ctx.n).expand(ctx.n)
        dpsi = torch.where(shard.owned, (torch.exp(log_p_target) - 1.0) * coef, 0.0)
        target_grad = dpsi * slope
        if extra_slope is not None:
            target_grad = target_grad + torch.where(shard.owned, extra_slope * g / ctx.n, 0.0)
        grad_e, grad_w = shard.grads(ctx.s, lse, coef.contiguous(), target_grad, log_p_target)
        if ctx.row_term is not None:
            grad_w = grad_w + g * ctx.row_term.grad_w
        grad_w = grad_w.to(ctx.weight_dtype)
        if shard.index is not None:  # row-sparse (as nn.Embedding(sparse=True)): no dense
            grad_w = torch.sparse_coo_tensor(  # [num_local, D]; index is sorted and unique
                shard.index[None], grad_w, ctx.weight_shape, is_coalesced=True,
                check_invariants=False)
        grad_aux = None
        if ctx.has_aux:
            grad_aux = dpsi * aux_slope if aux_slope is not None else torch.zeros_like(dpsi)
        return None, None, None, None, None, None, None, None, grad_e, grad_w, grad_aux


def _target_slopes(target: TargetTerms, cos_t: Tensor, aux: Tensor | None
                   ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(psi'(c), d psi / d aux, extra'(c))`` elementwise on the ``[N]`` target cosines (None
    where there is no such input or term)."""
    with torch.enable_grad():
        c = cos_t.detach().requires_grad_()
        a = None if aux is None else aux.detach().requires_grad_()
        inputs = [c] if a is None else [c, a]
        grads = torch.autograd.grad(target.psi(c, a).sum(), inputs, allow_unused=True)
        slope = torch.zeros_like(c) if grads[0] is None else grads[0]
        aux_slope = grads[1] if a is not None else None
        extra_slope = None
        if target.extra is not None:
            (extra_slope,) = torch.autograd.grad(target.extra(c).sum(), c)
    return slope, aux_slope, extra_slope
