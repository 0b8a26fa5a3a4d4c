"""Class-sharded margin softmax cross-entropy with a hand-written backward (Megatron-style).

Each rank holds the cosines ``cos [N, S]`` of the whole global batch against its ``S`` local
classes; the loss is ``F.cross_entropy`` of the full ``[N, C]`` logits, which no rank holds.
Ordinary autograd over that path keeps two or three ``[N, S]`` buffers alive at peak during
backward; this Function keeps one: the softmax probabilities, which its backward turns, in
place, into the gradient w.r.t. ``cos``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from partial_fc import distributed as pd

__all__ = ["margin_softmax_loss"]


def margin_softmax_loss(
    cos: Tensor,
    rows: Tensor,
    cols: Tensor,
    psi: Callable[[Tensor], Tensor],
    s: Tensor | float,
    process_group: pd.ProcessGroup = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Mean cross-entropy of the global batch over the class shards of ``process_group``.

    Logits: ``z_ik = s * cos_ik`` for ``k != y_i`` and ``z_iy = s * psi(cos_iy)`` (arXiv:1801.07698
    Eq. 3-4); ``loss = mean_i [log sum_k exp(z_ik) - z_iy]`` over all ``N`` rows and all ranks'
    classes. Called by every rank of ``process_group`` (``None`` = WORLD) with the same ``N``.

    Args:
        cos: ``[N, S]`` float, this rank's cosines (fp32 under autocast: the head casts);
            never modified.
        rows, cols: ``[n_owned]`` int64, the target entries this rank owns
            (``cos[rows, cols]``; each row at most once).
        psi: elementwise margin transform of target cosines, ``[n] -> [n]``, differentiable.
        s: the scale, a constant for the step (float or 0-d tensor; no gradient flows to it).

    Returns:
        ``loss`` (0-d, identical on all ranks, differentiable w.r.t. ``cos``); ``sum_exp``
        ``[N]``, ``sum_{k != y_i} exp(z_ik - shift_i)`` over all ranks; ``shift`` ``[N]``, the
        detached global row max of the logits. Both are replicated and carry no gradient.
    """
    return _MarginSoftmaxLoss.apply(process_group, psi, s, cos, rows, cols)


class _MarginSoftmaxLoss(Function):
    """forward: loss via all-reduce MAX (detached shift), SUM of sum-exp and target logit;
    backward: ``d loss / d cos`` from the saved probabilities, in place.

    With ``p`` the global softmax of the logits and ``g`` the incoming loss gradient::

        d loss / d cos_ik = g * s * (p_ik - 1[k = y_i]) / N * (psi'(cos_iy) if k = y_i else 1)

    Saved: ``p`` restricted to this rank's classes (the one ``[N, S]`` buffer, computed in
    place from the logits), ``rows``, ``cols`` and the owned target cosines ``[n_owned]``;
    ``psi'`` comes from a small autograd call on that 1-D vector in backward. Backward
    overwrites ``p``, so a second backward through the same graph raises (saved tensor
    modified in place) instead of returning wrong gradients; no double backward.
    """

    @staticmethod
    def forward(ctx, group, psi, s, cos, rows, cols):
        n = cos.shape[0]
        cos_t = cos[rows, cols]
        t_logit = psi(cos_t) * s
        logits = cos * s  # the one [N, S] buffer: logits -> exp -> probabilities
        logits.index_put_((rows, cols), torch.full_like(t_logit, -math.inf))
        row_max = logits.amax(dim=1)
        row_max[rows] = torch.maximum(row_max[rows], t_logit)
        shift = pd.all_reduce_max(row_max, group)  # [N]
        probs = logits.sub_(shift[:, None]).exp_()
        partial = torch.stack([probs.sum(dim=1),
                               torch.zeros_like(shift).index_put((rows,), t_logit - shift[rows])])
        sum_exp, target = pd.all_reduce(partial, group)  # [N] each, replicated
        total = sum_exp + torch.exp(target)
        loss = (torch.log(total) - target).mean()
        probs.div_(total[:, None]).index_put_((rows, cols), torch.exp(target[rows]) / total[rows])
        ctx.psi, ctx.s, ctx.n = psi, s, n
        ctx.save_for_backward(probs, rows, cols, cos_t)
        ctx.mark_non_differentiable(sum_exp, shift)
        return loss, sum_exp, shift

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_sum_exp, _grad_shift):
        probs, rows, cols, cos_t = ctx.saved_tensors
        with torch.enable_grad():  # psi' on the 1-D target vector only
            c = cos_t.detach().requires_grad_()
            (slope,) = torch.autograd.grad(ctx.psi(c).sum(), c)
        coef = grad_loss * ctx.s / ctx.n
        p_t = probs[rows, cols]
        grad = probs.mul_(coef)  # non-targets: g * s * p / N
        grad.index_put_((rows, cols), (p_t - 1.0) * slope * coef)
        return None, None, None, grad, None, None
