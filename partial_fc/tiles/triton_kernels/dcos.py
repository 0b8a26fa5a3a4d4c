"""The backward's first kernel, ``_dcos_kernel``: ``dL/dcos`` tile by tile, per chunk of classes.

It recomputes ``cos`` and writes ``G' = dL/dcos diag(inv_norm)`` in the operand dtype (one
``[N, width]`` buffer of at most 256 MiB, never ``[N, S]``) plus the column sums
``r_k = sum_i dL/dcos_ik cos_ik`` that the weight gradient's GEMM (:mod:`.gemm`) needs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from partial_fc.tiles.triton_kernels.tile_ops import (
    _cos_tile,
    _dcos_tile,
    _operand,
    _step_constants,
)


@triton.jit
def _dcos_kernel(E, W, INV, TGT, SCALE, HARD_ABOVE, T, LSE, COEF, TGRAD, G_OUT, R_OUT,
                 SKIP_BELOW, LIVE_OUT, N, D, stride_e, stride_w, stride_g, stride_r,
                 stride_live, col0, width, tau,
                 BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                 OP: tl.constexpr, DOT: tl.constexpr, SOFT_BF16: tl.constexpr,
                 PRECISION: tl.constexpr, CLAMP: tl.constexpr, FILTER: tl.constexpr,
                 HARD: tl.constexpr, SKIP: tl.constexpr):
    """Program (row block, class tile of the chunk ``[col0, col0 + width)``): recompute
    ``cos``, write ``G'_ik = dL/dcos_ik inv_k`` in the operand dtype to ``G_OUT [N, width]``
    and the row block's ``sum_i dL/dcos_ik cos_ik`` (= ``w_hat_k . g_k`` over these rows) to
    ``R_OUT [row blocks, width]``. ``SKIP`` (the filtered backward, ``partial_fc.tiles.
    filtered``): a tile whose every ``|dL/dcos_ik|`` is below its row's ``SKIP_BELOW_i`` is
    written as zeros (``G'`` and ``r``), and ``LIVE_OUT [row blocks, tiles]`` gets 0 for it,
    1 for the others, for the GEMMs to skip it."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    local = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok = rows < N
    col_ok = local < width
    cols = col0 + local
    tgt = tl.load(TGT + rows, mask=row_ok, other=-1)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    coef = tl.load(COEF + rows, mask=row_ok, other=0.0)
    tgrad = tl.load(TGRAD + rows, mask=row_ok, other=0.0)
    s = tl.load(SCALE)
    hard_above, t_hard = _step_constants(HARD_ABOVE, T, rows, row_ok, HARD)
    cos = _cos_tile(E, W, INV, rows, cols, row_ok, col_ok, D, stride_e, stride_w,
                    BLOCK_N, BLOCK_S, BLOCK_D, OP, DOT, SOFT_BF16, PRECISION)
    g = _dcos_tile(cos, cols, col_ok, tgt, s, lse, coef, tgrad, hard_above, t_hard, tau,
                   CLAMP, FILTER, HARD)
    if SKIP:  # masked rows (G = 0) never keep a tile; a bound of 0 keeps every tile
        below = tl.load(SKIP_BELOW + rows, mask=row_ok, other=float("inf"))
        live = tl.max(tl.max(tl.where(tl.abs(g) >= below[:, None], 1, 0), axis=1), axis=0)
        g = g * live
        tl.store(LIVE_OUT + tl.program_id(0) * stride_live + tl.program_id(1), live)
    inv = tl.load(INV + cols, mask=col_ok, other=0.0)
    g_scaled = _operand(g * inv[None, :], OP, DOT, SOFT_BF16).to(G_OUT.dtype.element_ty)
    tl.store(G_OUT + rows[:, None] * stride_g + local[None, :], g_scaled,
             mask=row_ok[:, None] & col_ok[None, :])
    tl.store(R_OUT + tl.program_id(0) * stride_r + local, tl.sum(g * cos, axis=0), mask=col_ok)
