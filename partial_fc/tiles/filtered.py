"""The filtered backward of the class tiles: skip a tile whose gradient is below the rounding.

Off by default: the kernels' exact backward runs unless ``partial_fc.tiles.triton.
class_tile_grads`` is given ``skip=Skip(below)``. Cut Cross-Entropy (arXiv:2411.09009) skips
the backward blocks whose softmax entries are all below ``2^-12``; that threshold is absolute
and carries no bound on the error it adds. Here the threshold is per row and derived so that
what is skipped stays below the rounding the kernels already do to ``G'`` (docs/kernels.md,
"The filtered backward"):

Write ``G_ik = dL/dcos_ik`` over the ``C`` columns of all ranks and ``M_i = sum_k |G_ik|``.
The kernels round ``G'_ik = G_ik inv_k`` to the operand dtype (unit roundoff ``u``: ``2^-8``
for bf16, ``2^-11`` fp16, ``2^-24`` fp32) before the two GEMMs, so each term ``G'_ik w_k`` of
``grad_e_i`` moves by up to ``u |G_ik|`` in norm (``||inv_k w_k|| = 1``): the exact backward
already leaves ``grad_e_i`` anywhere within ``u M_i`` of its exact value, and ``grad_w``,
summed over its rows, within ``u sum_i M_i``. A tile is skipped (its ``G'`` and ``r`` written
as zeros, its GEMM steps not run) only if every ``|G_ik|`` in it is below its row's skip bound
``skip_i`` (``Skip.below``, the kernels' ``SKIP_BELOW``; not the inter-class filter's ``tau``);
row ``i`` has at most ``C`` such entries, so what its skipped tiles drop is below ``C skip_i``.
With

    skip_i = u m_i / C,   m_i = |coef_i| (1 - p_iy) <= M_i

the dropped sum is below ``u M_i``: within what rounding already allows, for every row of
``grad_e`` and for ``grad_w`` summed over its rows (not for each row of ``grad_w`` alone: a
class no sample of the batch is near can lose its whole, tiny, gradient). ``m_i`` is the
non-target part of ``M_i``: ``|G_ik| = |coef_i| p_ik`` off the target for plain non-target
logits (``f' = 1``), and those ``p_ik`` sum to ``1 - p_iy``; a non-target transform
(``partial_fc.nontarget``: AdaFace's clamp, the inter-class filter, CurricularFace's
modulation) changes the slopes, so the kernels refuse ``skip`` with one. ``C`` may be any
upper bound of the columns (the head's ``num_classes``; at ``r < 1`` fewer are sampled, and
the bound is stricter than it needs to be).

What it skips: an entry is below ``skip_i`` when its share of the row's non-target mass,
``p_ik / (1 - p_iy)``, is below ``u / C``: ``2^8`` times below the mean share ``1 / C``. A flat
softmax (initial weights: the non-target logits within ``ln 2^8 = 5.5`` of each other) has no
such entry, so nothing is skipped there; a tile is skipped only when the logits separate so
far that all its ``rows x cols`` entries sit that low at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Skip", "live_blocks", "operand_dtype", "skip_bounds", "unit_roundoff"]


@dataclass(frozen=True)
class Skip:
    """The filtered backward's per-row bound ``below [N]`` fp32 on ``|dL/dcos_ik|``
    (:func:`skip_bounds`; 0 keeps a row's every tile) and, optionally, ``tiles`` an int64
    ``[2]`` that each call adds ``(tiles skipped, tiles)`` to, on the device (no host read)."""

    below: Tensor
    tiles: Tensor | None = None


def operand_dtype(e_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
    """The kernels' dot operand dtype, ``G'``'s: the narrower of ``e``'s and ``w``'s (bf16 or
    fp16 when either is, as autocast does; fp32 only when both are)."""
    return ({e_dtype, w_dtype} - {torch.float32} or {torch.float32}).pop()


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u`` of ``dtype``, round to nearest: half its machine epsilon (bf16: ``2^-8``)."""
    return torch.finfo(dtype).eps / 2


def skip_bounds(coef: Tensor, log_p_target: Tensor, classes: int,
                dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``skip_i = u |coef_i| (1 - p_iy) / classes`` (module docstring): ``coef`` ``[N]`` as
    ``class_tile_grads`` takes it, ``log_p_target`` ``[N]`` the global ``log p_iy``, ``classes``
    an upper bound of the columns of all ranks, ``dtype`` the kernels' operand dtype (``G'``'s)."""
    if classes < 1:
        raise ValueError(f"skip_bounds: classes={classes} must be at least 1")
    mass = coef.float().abs() * -torch.expm1(log_p_target.float())
    return (unit_roundoff(dtype) / classes) * mass


def live_blocks(live: Tensor, rows: tuple[int, int], cols: tuple[int, int],
                shape: tuple[int, int]) -> Tensor:
    """``live [row blocks, col blocks]`` (1: the block was kept) of blocks of ``rows[0] x
    cols[0]`` as the flags of blocks of ``rows[1] x cols[1]`` (powers of two), ``shape`` of
    them: a block is kept when any block it overlaps was. A GEMM skips a K step only where
    every ``G'`` tile under it was skipped."""
    for dim, (have, want) in enumerate((rows, cols)):
        if want > have:  # several old blocks per new one: any of them kept
            group = want // have
            pad = -live.shape[dim] % group
            if pad:
                live = torch.cat([live, live.new_zeros(*(
                    (pad, live.shape[1]) if dim == 0 else (live.shape[0], pad)))], dim=dim)
            live = (live.unflatten(dim, (-1, group)).amax(dim=dim + 1))
        elif want < have:
            live = live.repeat_interleave(have // want, dim=dim)
    return live[:shape[0], :shape[1]].contiguous()
