"""The class-tile passes as cuBLAS matmuls on class chunks with Triton epilogues.

The other engine of ``partial_fc.tiles.triton`` (``Tiles.engine == "cublas"``), with the same
semantics and arguments (the module docstring there has the notation): the Triton kernels
there recompute each cosine tile inside their own GEMMs; here each chunk of ``width`` classes
is one torch matmul (cuBLAS on CUDA, 16-bit operands with fp32 output, ``out_dtype``) and the
softmax work runs as elementwise Triton kernels over the chunk's ``X = E W_c^T`` ``[N, width]``
fp32, with the same tile operations the kernels use (``triton_kernels.tile_ops``:
``_nontarget``, ``_dcos_tile``, ``_operand``).
Which engine is faster depends on the card and the shape: the tuner (``partial_fc.tiles.
autotune``) times both and the choice is said once.

- Forward, per chunk: ``X``, then ``_stats_epilogue`` (grid: row block x column tile) writes
  each tile's row max and sum-exp of ``s f(cos)`` and the raw cosine sum over the non-target
  columns (and CurricularFace's hard-negative count); the tiles' partials and the chunks
  before are combined in PyTorch, row 0 of the partials buffer holding the running result.
- Backward, per chunk: ``X`` again, ``_dcos_epilogue`` writes ``G' = dL/dcos diag(inv)`` in
  the operand dtype and the row blocks' ``r_k = sum_i dL/dcos_ik cos_ik``; two matmuls give
  ``grad_e += G' W_c`` and ``grad_w_c = G'^T E - diag(inv^2 r) W_c`` (fp32, rounded once to
  a 16-bit ``w``'s dtype).

Memory: the chunk holds ``X`` (fp32) and ``G'`` (operand dtype) within ``Tiles.buffer_bytes``.
Off a GPU (``TRITON_INTERPRET=1``) the matmuls run in fp32 on operands rounded to the operand
dtype, which is exact per product, as the reference does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from partial_fc.nontarget import NonTarget
from partial_fc.tiles import triton as tm  # without triton: the ImportError naming the fix
from partial_fc.tiles.triton import tl, triton
from partial_fc.tiles.triton_kernels.tile_ops import (
    _dcos_tile,
    _nontarget,
    _operand,
    _step_constants,
)

__all__ = ["class_tile_grads", "class_tile_stats"]


@triton.jit
def _stats_epilogue(X, INV, TGT, SCALE, HARD_ABOVE, T, MAX_OUT, SUM_OUT, COS_OUT, HARD_OUT,
                    N, width, col0, stride_x, tau,
                    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, CLAMP: tl.constexpr,
                    FILTER: tl.constexpr, HARD: tl.constexpr):
    """Program (row block, column tile of the chunk ``[col0, col0 + width)``): the tile's row
    max and sum-exp (shifted by that max) of ``s f(cos)``, raw cosine sum and hard-negative
    count over its non-target columns -> row ``tile`` of the ``[tiles, N]`` partials."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    local = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok, col_ok = rows < N, local < width
    cols = col0 + local
    tgt = tl.load(TGT + rows, mask=row_ok, other=-1)
    hard_above, t_hard = _step_constants(HARD_ABOVE, T, rows, row_ok, HARD)
    x = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + local[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    cos = x * tl.load(INV + cols, mask=col_ok, other=0.0)[None, :]
    keep = col_ok[None, :] & (cols[None, :] != tgt[:, None])
    f, _, hard = _nontarget(cos, hard_above, t_hard, tau, CLAMP, FILTER, HARD)
    z = tl.where(keep, tl.load(SCALE) * f, float("-inf"))
    top = tl.max(z, axis=1)
    shift = tl.where(top == float("-inf"), 0.0, top)  # a row with no column here: sum 0
    out = tl.program_id(1) * N + rows
    tl.store(MAX_OUT + out, top, mask=row_ok)
    tl.store(SUM_OUT + out, tl.sum(tl.exp(z - shift[:, None]), axis=1), mask=row_ok)
    tl.store(COS_OUT + out, tl.sum(tl.where(keep, cos, 0.0), axis=1), mask=row_ok)
    if HARD:
        tl.store(HARD_OUT + out, tl.sum(tl.where(keep & hard, 1.0, 0.0), axis=1), mask=row_ok)


@triton.jit
def _dcos_epilogue(X, INV, TGT, SCALE, HARD_ABOVE, T, LSE, COEF, TGRAD, G_OUT, R_OUT,
                   N, width, col0, stride_x, stride_g, stride_r, tau,
                   BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, OP: tl.constexpr,
                   DOT: tl.constexpr, SOFT_BF16: tl.constexpr, CLAMP: tl.constexpr,
                   FILTER: tl.constexpr, HARD: tl.constexpr):
    """Program (row block, column tile of the chunk): ``G'_ik = dL/dcos_ik inv_k`` rounded to
    the operand dtype into ``G_OUT [N, width]``, the row block's ``sum_i dL/dcos_ik cos_ik``
    into ``R_OUT [row blocks, width]``."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    local = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok, col_ok = rows < N, local < width
    cols = col0 + local
    mask = row_ok[:, None] & col_ok[None, :]
    hard_above, t_hard = _step_constants(HARD_ABOVE, T, rows, row_ok, HARD)
    inv = tl.load(INV + cols, mask=col_ok, other=0.0)
    cos = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + local[None, :], mask=mask,
                  other=0.0) * inv[None, :]
    g = _dcos_tile(cos, cols, col_ok, tl.load(TGT + rows, mask=row_ok, other=-1),
                   tl.load(SCALE), tl.load(LSE + rows, mask=row_ok, other=0.0),
                   tl.load(COEF + rows, mask=row_ok, other=0.0),
                   tl.load(TGRAD + rows, mask=row_ok, other=0.0), hard_above, t_hard, tau,
                   CLAMP, FILTER, HARD)
    scaled = _operand(g * inv[None, :], OP, DOT, SOFT_BF16).to(G_OUT.dtype.element_ty)
    tl.store(G_OUT + rows.to(tl.int64)[:, None] * stride_g + local[None, :], scaled, mask=mask)
    tl.store(R_OUT + tl.program_id(0) * stride_r + local, tl.sum(g * cos, axis=0), mask=col_ok)


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` in fp32 from operands already in the operand dtype: cuBLAS with fp32 output
    for 16-bit operands on CUDA (fp32 operands follow torch's TF32 setting, as the kernels);
    elsewhere fp32 products of the (exactly widened) operands. Autocast is off here: the
    head calls the tiles inside the user's autocast, which would round the output to 16 bits
    (and cast fp32 operands down)."""
    with torch.autocast(a.device.type, enabled=False):
        if a.device.type == "cuda" and a.dtype != torch.float32:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a.float(), b.float())


def _operand_dtype(e: Tensor, w: Tensor) -> torch.dtype:
    return tm.operand_constexprs(e.dtype, w.dtype, widen=False, fp32_exact=True)[0]


def _merge(parts: Tensor, tiles: int) -> None:
    """Rows ``0 .. tiles`` of the partials ``[3 (+1), 1 + T, N]`` (max, shifted sum-exp, cosine
    sum, hard count) into row 0, the running result."""
    top = parts[0, :tiles + 1]
    row_max = top.amax(dim=0)
    shift = torch.where(torch.isinf(row_max), 0.0, row_max)  # no column anywhere yet
    parts[1, 0] = (parts[1, :tiles + 1] * torch.exp(top - shift)).sum(dim=0)
    parts[2:, 0] = parts[2:, :tiles + 1].sum(dim=1)
    parts[0, 0] = row_max


def class_tile_stats(e: Tensor, w: Tensor, inv_norm: Tensor, target_col: Tensor,
                     s: Tensor | float, nontarget: NonTarget | None = None,
                     tiles: tm.Tiles | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``partial_fc.tiles.triton.class_tile_stats`` on this engine (its arguments and
    checks; ``tiles`` sets the epilogues' tiles and the chunk budget)."""
    (e, w, inv_norm, target_col), scale, _, _ = tm._prepare(e, w, inv_norm, target_col, s, {})
    t = tiles or tm.default_tiles(e)
    (hard_above, t_hard, tau), transform = tm._transform(nontarget, e, scale)
    n, s_cols = e.shape[0], w.shape[0]
    op = _operand_dtype(e, w)
    e_op = e.to(op)
    width_max = min(s_cols, t.chunk_width(n, 4))
    row_blocks = triton.cdiv(n, t.rows)
    parts = torch.zeros(3 + transform["HARD"], 1 + triton.cdiv(width_max, t.cols), n,
                        dtype=torch.float32, device=e.device)
    parts[0, 0] = float("-inf")
    for col0 in range(0, s_cols, width_max):
        width = min(width_max, s_cols - col0)
        x = _mm(e_op, w[col0:col0 + width].to(op).t())
        tiles = triton.cdiv(width, t.cols)
        _stats_epilogue[(row_blocks, tiles)](
            x, inv_norm, target_col, scale, hard_above, t_hard, parts[0, 1:], parts[1, 1:],
            parts[2, 1:], parts[-1, 1:], n, width, col0, x.stride(0), tau, BLOCK_N=t.rows,
            BLOCK_S=t.cols, **transform, **t.launch_options)
        _merge(parts, tiles)
    if transform["HARD"] and nontarget.hard_rows is not None:
        nontarget.hard_rows.add_(parts[3, 0])
    row_max, row_sum, cos_sum = parts[:3, 0].clone()
    return row_max, row_sum, cos_sum


def class_tile_grads(e: Tensor, w: Tensor, inv_norm: Tensor, target_col: Tensor,
                     s: Tensor | float, lse: Tensor, coef: Tensor, target_grad: Tensor,
                     nontarget: NonTarget | None = None, tiles: tm.Tiles | None = None
                     ) -> tuple[Tensor, Tensor]:
    """``partial_fc.tiles.triton.class_tile_grads`` on this engine (its arguments and
    checks; ``tiles`` as in :func:`class_tile_stats`)."""
    extra = {"lse": lse, "coef": coef, "target_grad": target_grad}
    tensors, scale, op, consts = tm._prepare(e, w, inv_norm, target_col, s, extra)
    e, w, inv_norm, target_col, lse, coef, target_grad = tensors
    t = tiles or tm.default_tiles(e)
    (hard_above, t_hard, tau), transform = tm._transform(nontarget, e, scale)
    (n, d), s_cols = e.shape, w.shape[0]
    width_max = min(s_cols, t.chunk_width(n, 4 + op.itemsize))  # X and G'
    row_blocks = triton.cdiv(n, t.rows)
    buffer = torch.empty(n, width_max, dtype=op, device=e.device)
    radial = torch.empty(row_blocks, width_max, dtype=torch.float32, device=e.device)
    e_op = e.to(op)
    grad_e = torch.zeros(n, d, dtype=torch.float32, device=e.device)
    grad_w = torch.empty(s_cols, d, dtype=w.dtype, device=e.device)
    dtypes = {k: consts[k] for k in ("OP", "DOT", "SOFT_BF16")}
    for col0 in range(0, s_cols, width_max):
        width = min(width_max, s_cols - col0)
        w_c = w[col0:col0 + width]
        w_op, g, r = w_c.to(op), buffer[:, :width], radial[:, :width]
        x = _mm(e_op, w_op.t())
        _dcos_epilogue[(row_blocks, triton.cdiv(width, t.cols))](
            x, inv_norm, target_col, scale, hard_above, t_hard, lse, coef, target_grad, g, r,
            n, width, col0, x.stride(0), g.stride(0), r.stride(0), tau, BLOCK_N=t.rows,
            BLOCK_S=t.cols, **transform, **dtypes, **t.launch_options)
        del x
        grad_e += _mm(g, w_op)
        part = _mm(g.t(), e_op)
        project = inv_norm[col0:col0 + width].square() * r.sum(dim=0)
        grad_w[col0:col0 + width] = part.sub_(project[:, None] * w_c.float())
    return grad_e, grad_w
