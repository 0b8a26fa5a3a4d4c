"""The forward pass's kernel, ``_stats_kernel``: the row statistics of the non-target logits.

It recomputes ``cos`` tile by tile (as Cut Cross-Entropy does, arXiv:2411.09009) for an online
row max / sum-exp over non-target columns and the non-target cosine sum; programs run on
contiguous class *splits* and leave ``[splits, N]`` partials that a tiny PyTorch reduction in
``partial_fc.tiles.triton.class_tile_stats`` combines (deterministic, no atomics).
"""

from __future__ import annotations

import triton
import triton.language as tl

from partial_fc.tiles.triton_kernels.tile_ops import _cos_tile, _nontarget, _step_constants


@triton.jit
def _stats_kernel(E, W, INV, TGT, SCALE, HARD_ABOVE, T, MAX_OUT, SUM_OUT, COS_OUT, HARD_OUT,
                  N, S, D, stride_e, stride_w, tiles_per_split, tau,
                  BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  OP: tl.constexpr, DOT: tl.constexpr, SOFT_BF16: tl.constexpr,
                  PRECISION: tl.constexpr, CLAMP: tl.constexpr, FILTER: tl.constexpr,
                  HARD: tl.constexpr):
    """Program (row block, class split): online max / sum-exp of ``s f(cos)``
    (:func:`_nontarget`) and sum of the raw ``cos`` over the split's non-target columns, and
    with ``HARD`` the count of hard negatives -> ``[splits, N]`` partials."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    row_ok = rows < N
    tgt = tl.load(TGT + rows, mask=row_ok, other=-1)
    s = tl.load(SCALE)
    hard_above, t_hard = _step_constants(HARD_ABOVE, T, rows, row_ok, HARD)
    run_max = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    cos_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    hard_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = split * tiles_per_split
    for t in range(first, first + tiles_per_split):
        cols = t * BLOCK_S + tl.arange(0, BLOCK_S)
        col_ok = cols < S
        cos = _cos_tile(E, W, INV, rows, cols, row_ok, col_ok, D, stride_e, stride_w,
                        BLOCK_N, BLOCK_S, BLOCK_D, OP, DOT, SOFT_BF16, PRECISION)
        keep = col_ok[None, :] & (cols[None, :] != tgt[:, None])
        f, _, hard = _nontarget(cos, hard_above, t_hard, tau, CLAMP, FILTER, HARD)
        z = tl.where(keep, s * f, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(z, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no (-inf) - (-inf)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(z - shift[:, None]), axis=1)
        run_max = new_max
        cos_sum += tl.sum(tl.where(keep, cos, 0.0), axis=1)
        if HARD:
            hard_sum += tl.sum(tl.where(keep & hard, 1.0, 0.0), axis=1)
    out = split * N + rows
    tl.store(MAX_OUT + out, run_max, mask=row_ok)
    tl.store(SUM_OUT + out, run_sum, mask=row_ok)
    tl.store(COS_OUT + out, cos_sum, mask=row_ok)
    if HARD:
        tl.store(HARD_OUT + out, hard_sum, mask=row_ok)
