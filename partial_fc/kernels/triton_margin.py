"""Triton kernels for the class-tiled margin softmax head: no ``[N, S]`` tensor is ever written.

Same names and semantics as the PyTorch class-tile functions of ``partial_fc.chunked`` (the
reference these kernels are tested against); ``docs/kernels.md`` has the design, the FLOP and
byte floors and what was verified where. Notation: ``e [N, D]`` normalised embeddings, ``w [S, D]``
this rank's (sampled) weight rows, *not* normalised, ``inv_norm [S] = 1 / ||w_k||`` folded into
each tile (no normalised copy of ``w``), ``cos_ik = (e_i . w_k) inv_norm_k`` with fp32
accumulation (arXiv:1801.07698 Eq. 2-3), ``target_col [N]`` the column of row ``i``'s target in
``w`` (``-1``: another rank's or not sampled).

Three kernels, each recomputing its ``cos`` tiles from ``e`` and ``w`` (Cut Cross-Entropy,
arXiv:2411.09009): ``_stats_kernel`` (online row max / sum-exp over non-target columns, the
non-target cosine sum), ``_grad_e_kernel`` (``dE``, a reduction over classes) and
``_grad_w_kernel`` (``dW``, a reduction over rows, written once per class tile with the chain rule
through ``1 / ||w||``). Programs over the long class axis run on contiguous class *splits* and
leave per-split partials (``[splits, N]`` statistics, ``[splits, N, D]`` for ``dE``) that a tiny
PyTorch reduction combines: deterministic, no atomics.

Operand precision: the dot operands are cast to the narrower of ``e.dtype`` and ``w.dtype``
(bf16 or fp16 when either is, as autocast does; fp32 only when both are, with IEEE fp32 dots,
not TF32); accumulation, ``exp`` and all outputs are fp32. In backward ``dL/dcos`` is rounded to
that operand dtype before its two matmuls, as autocast's matmul backward rounds its incoming
gradient (fp16: values below 2**-24 underflow, which a GradScaler'd ``coef`` prevents, as in
autocast). Under ``TRITON_INTERPRET=1`` (CPU tensors) 16-bit operands are rounded to their dtype
and then widened to fp32 for ``tl.dot``: triton 3.9's interpreter multiplies bf16 tiles as raw
uint16 bits, and its fp32 -> bf16 cast truncates, so bf16 rounding is done there with integer
ops (``_operand``). The widening is exact and a product of two 16-bit floats is exact in fp32,
so only the summation order differs from a tensor-core MMA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError as err:  # triton ships with CUDA builds of torch, not with CPU ones
    raise ImportError(
        "partial_fc.kernels.triton_margin needs triton, which is not installed: "
        "pip install triton (it ships with CUDA builds of torch); on CPU use the PyTorch "
        "class-tile path of partial_fc.chunked"
    ) from err

__all__ = ["class_tile_stats", "class_tile_grads"]

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _operand(x, OP: tl.constexpr, DOT: tl.constexpr, SOFT_BF16: tl.constexpr):
    """``x`` rounded to the operand dtype ``OP`` (nearest even), as the dot's dtype ``DOT``.
    ``SOFT_BF16`` (interpreter only): round to bf16 with integer ops, since the interpreter's
    fp32 -> bf16 cast truncates; the result stays fp32 (``DOT`` is fp32 there)."""
    if SOFT_BF16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(OP).to(DOT)


@triton.jit
def _cos_tile(E, W, INV, rows, cols, row_ok, col_ok, D, stride_e, stride_w,
              BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
              OP: tl.constexpr, DOT: tl.constexpr, SOFT_BF16: tl.constexpr,
              PRECISION: tl.constexpr):
    """``cos [BLOCK_N, BLOCK_S]`` fp32 for ``rows`` x ``cols``; 0 where masked."""
    acc = tl.zeros((BLOCK_N, BLOCK_S), dtype=tl.float32)
    e_rows = E + rows.to(tl.int64)[:, None] * stride_e
    w_rows = W + cols.to(tl.int64)[:, None] * stride_w
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        d_ok = dd < D
        a = tl.load(e_rows + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        b = tl.load(w_rows + dd[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        acc = tl.dot(_operand(a, OP, DOT, SOFT_BF16), tl.trans(_operand(b, OP, DOT, SOFT_BF16)),
                     acc, input_precision=PRECISION)
    inv = tl.load(INV + cols, mask=col_ok, other=0.0)
    return acc * inv[None, :]


@triton.jit
def _dcos_tile(cos, cols, col_ok, tgt, s, lse, coef, tgrad):
    """``dL/dcos`` of a tile: ``coef_i exp(s cos_ik - lse_i)`` off target, ``tgrad_i`` on it,
    0 on masked columns (masked rows carry ``coef = tgrad = 0``, ``tgt = -1``)."""
    p = coef[:, None] * tl.exp(s * cos - lse[:, None])
    g = tl.where(col_ok[None, :], p, 0.0)
    return tl.where(cols[None, :] == tgt[:, None], tgrad[:, None], g)


@triton.jit
def _stats_kernel(E, W, INV, TGT, SCALE, MAX_OUT, SUM_OUT, COS_OUT,
                  N, S, D, stride_e, stride_w, tiles_per_split,
                  BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  OP: tl.constexpr, DOT: tl.constexpr, SOFT_BF16: tl.constexpr,
              PRECISION: tl.constexpr):
    """Program (row block, class split): online max / sum-exp of ``s cos`` and sum of ``cos``
    over the split's non-target columns -> ``[splits, N]`` partials."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    row_ok = rows < N
    tgt = tl.load(TGT + rows, mask=row_ok, other=-1)
    s = tl.load(SCALE)
    run_max = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    cos_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = split * tiles_per_split
    for t in range(first, first + tiles_per_split):
        cols = t * BLOCK_S + tl.arange(0, BLOCK_S)
        col_ok = cols < S
        cos = _cos_tile(E, W, INV, rows, cols, row_ok, col_ok, D, stride_e, stride_w,
                        BLOCK_N, BLOCK_S, BLOCK_D, OP, DOT, SOFT_BF16, PRECISION)
        keep = col_ok[None, :] & (cols[None, :] != tgt[:, None])
        z = tl.where(keep, s * cos, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(z, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no (-inf) - (-inf)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(z - shift[:, None]), axis=1)
        run_max = new_max
        cos_sum += tl.sum(tl.where(keep, cos, 0.0), axis=1)
    out = split * N + rows
    tl.store(MAX_OUT + out, run_max, mask=row_ok)
    tl.store(SUM_OUT + out, run_sum, mask=row_ok)
    tl.store(COS_OUT + out, cos_sum, mask=row_ok)


@triton.jit
def _grad_e_kernel(E, W, INV, TGT, SCALE, LSE, COEF, TGRAD, OUT,
                   N, S, D, stride_e, stride_w, tiles_per_split,
                   BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                   D_PAD: tl.constexpr, OP: tl.constexpr, DOT: tl.constexpr,
                   SOFT_BF16: tl.constexpr, PRECISION: tl.constexpr):
    """Program (row block, class split): ``sum_k dL/dcos_ik inv_k w_k`` over the split's
    columns, accumulated in registers -> ``OUT [splits, N, D]`` partial."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    row_ok = rows < N
    tgt = tl.load(TGT + rows, mask=row_ok, other=-1)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    coef = tl.load(COEF + rows, mask=row_ok, other=0.0)
    tgrad = tl.load(TGRAD + rows, mask=row_ok, other=0.0)
    s = tl.load(SCALE)
    dd = tl.arange(0, D_PAD)
    d_ok = dd < D
    acc = tl.zeros((BLOCK_N, D_PAD), dtype=tl.float32)
    first = split * tiles_per_split
    for t in range(first, first + tiles_per_split):
        cols = t * BLOCK_S + tl.arange(0, BLOCK_S)
        col_ok = cols < S
        cos = _cos_tile(E, W, INV, rows, cols, row_ok, col_ok, D, stride_e, stride_w,
                        BLOCK_N, BLOCK_S, BLOCK_D, OP, DOT, SOFT_BF16, PRECISION)
        g = _dcos_tile(cos, cols, col_ok, tgt, s, lse, coef, tgrad)
        inv = tl.load(INV + cols, mask=col_ok, other=0.0)
        w = tl.load(W + cols.to(tl.int64)[:, None] * stride_w + dd[None, :],
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        acc = tl.dot(_operand(g * inv[None, :], OP, DOT, SOFT_BF16),
                     _operand(w, OP, DOT, SOFT_BF16), acc, input_precision=PRECISION)
    out = OUT + (split * N + rows).to(tl.int64)[:, None] * D + dd[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _grad_w_kernel(E, W, INV, TGT, SCALE, LSE, COEF, TGRAD, OUT,
                   N, S, D, stride_e, stride_w,
                   BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                   D_PAD: tl.constexpr, OP: tl.constexpr, DOT: tl.constexpr,
                   SOFT_BF16: tl.constexpr, PRECISION: tl.constexpr):
    """Program (class tile): ``g_k = sum_i dL/dcos_ik e_i`` over all rows in registers, then
    ``OUT[k] = inv_k (g_k - w_hat_k (w_hat_k . g_k))``, the gradient w.r.t. the unnormalised
    ``w_k`` (``d w_hat / d w = inv (I - w_hat w_hat^T)``)."""
    cols = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    col_ok = cols < S
    s = tl.load(SCALE)
    dd = tl.arange(0, D_PAD)
    d_ok = dd < D
    acc = tl.zeros((BLOCK_S, D_PAD), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        tgt = tl.load(TGT + rows, mask=row_ok, other=-1)
        lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
        coef = tl.load(COEF + rows, mask=row_ok, other=0.0)
        tgrad = tl.load(TGRAD + rows, mask=row_ok, other=0.0)
        cos = _cos_tile(E, W, INV, rows, cols, row_ok, col_ok, D, stride_e, stride_w,
                        BLOCK_N, BLOCK_S, BLOCK_D, OP, DOT, SOFT_BF16, PRECISION)
        g = _dcos_tile(cos, cols, col_ok, tgt, s, lse, coef, tgrad)
        e = tl.load(E + rows.to(tl.int64)[:, None] * stride_e + dd[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        acc = tl.dot(_operand(tl.trans(g), OP, DOT, SOFT_BF16), _operand(e, OP, DOT, SOFT_BF16),
                     acc, input_precision=PRECISION)
    cols64 = cols.to(tl.int64)[:, None]
    mask = col_ok[:, None] & d_ok[None, :]
    inv = tl.load(INV + cols, mask=col_ok, other=0.0)
    w_hat = tl.load(W + cols64 * stride_w + dd[None, :], mask=mask, other=0.0).to(tl.float32)
    w_hat = w_hat * inv[:, None]
    radial = tl.sum(w_hat * acc, axis=1)
    tl.store(OUT + cols64 * D + dd[None, :], inv[:, None] * (acc - w_hat * radial[:, None]),
             mask=mask)


@dataclass(frozen=True)
class _Launch:
    """Tile sizes and grid split of one call (see ``docs/kernels.md`` for the choices)."""

    block_n: int
    block_s: int
    block_d: int
    num_warps: int
    num_stages: int
    programs: int  # how many programs the class splits aim at (a few per SM)


def _launch(device: torch.device, d_pad: int, backward: bool) -> _Launch:
    if device.type != "cuda":  # interpreter: small tiles, enough splits to test the combine
        return _Launch(16, 16, 16, 1, 1, programs=4)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if not backward:
        return _Launch(128, 128, 64, num_warps=8, num_stages=3, programs=4 * sms)
    block = 64 if d_pad <= 512 else 32  # a [block, d_pad] fp32 accumulator lives in registers
    return _Launch(block, block, 64, num_warps=8, num_stages=2, programs=4 * sms)


def _splits(n: int, s: int, cfg: _Launch) -> tuple[int, int]:
    """``(splits, tiles_per_split)``: contiguous class splits so that row blocks x splits
    reaches ``cfg.programs``; no split is empty."""
    tiles = triton.cdiv(s, cfg.block_s)
    want = max(1, min(tiles, triton.cdiv(cfg.programs, triton.cdiv(n, cfg.block_n))))
    per = triton.cdiv(tiles, want)
    return triton.cdiv(tiles, per), per


def _prepare(e: Tensor, w: Tensor, inv_norm: Tensor, target_col: Tensor, s: Tensor | float,
             extra: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, dict]:
    """Validate shapes/dtypes/devices; return contiguous operands, the scale as a 1-element
    fp32 tensor (no host sync for an AdaCos tensor scale) and the kernel's dtype constexprs."""
    if e.dim() != 2 or w.dim() != 2 or e.shape[1] != w.shape[1]:
        raise ValueError(f"triton_margin: e {tuple(e.shape)} and w {tuple(w.shape)} must be "
                         "[N, D] and [S, D] with the same D")
    n, s_cols = e.shape[0], w.shape[0]
    if e.dtype not in _TL_DTYPES or w.dtype not in _TL_DTYPES:
        raise ValueError(f"triton_margin: e/w dtypes {e.dtype}/{w.dtype}; supported: "
                         "float32, bfloat16, float16")
    narrow = {e.dtype, w.dtype} - {torch.float32}
    if len(narrow) > 1:
        raise ValueError("triton_margin: e and w mix bfloat16 and float16; cast one of them")
    shapes = {"inv_norm": (inv_norm, (s_cols,), torch.float32),
              "target_col": (target_col, (n,), torch.int64),
              **{k: (v, (n,), torch.float32) for k, v in extra.items()}}
    for name, (t, shape, dtype) in shapes.items():
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"triton_margin: {name} is {t.dtype} {tuple(t.shape)}, expected "
                             f"{dtype} {shape}")
    tensors = [e, w, inv_norm, target_col, *extra.values()]
    if any(t.device != e.device for t in tensors):
        raise ValueError("triton_margin: all tensors must be on one device")
    interpret = bool(triton.knobs.runtime.interpret)
    if e.device.type != "cuda" and not interpret:
        raise ValueError(f"triton_margin: tensors on {e.device} need TRITON_INTERPRET=1 "
                         "(slow, for tests); on CPU use partial_fc.chunked")
    op = narrow.pop() if narrow else torch.float32
    widen = interpret or e.device.type != "cuda"  # see the module docstring
    consts = dict(OP=_TL_DTYPES[op], DOT=tl.float32 if widen else _TL_DTYPES[op],
                  SOFT_BF16=widen and op == torch.bfloat16,
                  PRECISION="ieee" if op == torch.float32 else "tf32")
    scale = torch.as_tensor(s, dtype=torch.float32, device=e.device).detach().reshape(1)
    return e.contiguous(), w.contiguous(), inv_norm.contiguous(), target_col.contiguous(), \
        scale, consts


def class_tile_stats(e: Tensor, w: Tensor, inv_norm: Tensor, target_col: Tensor,
                     s: Tensor | float, chunk: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Row statistics of the non-target logits ``s cos_ik`` of this rank's classes.

    Args:
        e: ``[N, D]`` normalised embeddings (fp32/bf16/fp16). w: ``[S, D]`` weight rows, not
            normalised. inv_norm: ``[S]`` fp32 ``1 / ||w_k||``. target_col: ``[N]`` int64,
            column of row ``i``'s target in ``w`` or ``-1``. s: the scale (float or 0-d tensor).
        chunk: ignored (the PyTorch path's memory budget); the kernels hold tiles only.

    Returns:
        ``row_max [N]`` fp32 ``max_k s cos_ik`` (``-inf`` if the row has no non-target column),
        ``row_sum [N]`` fp32 ``sum_k exp(s cos_ik - row_max_i)``, ``cos_sum [N]`` fp32
        ``sum_k cos_ik``; all over non-target columns ``k != target_col_i``.
    """
    del chunk
    e, w, inv_norm, target_col, scale, consts = _prepare(e, w, inv_norm, target_col, s, {})
    (n, d), s_cols = e.shape, w.shape[0]
    cfg = _launch(e.device, triton.next_power_of_2(d), backward=False)
    splits, per = _splits(n, s_cols, cfg)
    max_p, sum_p, cos_p = torch.empty(3, splits, n, dtype=torch.float32, device=e.device)
    _stats_kernel[(triton.cdiv(n, cfg.block_n), splits)](
        e, w, inv_norm, target_col, scale, max_p, sum_p, cos_p, n, s_cols, d,
        e.stride(0), w.stride(0), per, BLOCK_N=cfg.block_n, BLOCK_S=cfg.block_s,
        BLOCK_D=cfg.block_d, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **consts)
    row_max = max_p.amax(dim=0)
    shift = torch.where(torch.isinf(row_max), 0.0, row_max)  # all splits empty -> sum 0
    row_sum = (sum_p * torch.exp(max_p - shift)).sum(dim=0)
    return row_max, row_sum, cos_p.sum(dim=0)


def class_tile_grads(e: Tensor, w: Tensor, inv_norm: Tensor, target_col: Tensor,
                     s: Tensor | float, lse: Tensor, coef: Tensor, target_grad: Tensor,
                     chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """Gradients of the loss through the cosines, recomputing each ``cos`` tile.

    With ``G_ik = dL/dcos_ik``: ``coef_i exp(s cos_ik - lse_i)`` for ``k != target_col_i`` and
    ``target_grad_i`` at ``k = target_col_i``.

    Args:
        e, w, inv_norm, target_col, s, chunk: as in ``class_tile_stats``.
        lse: ``[N]`` fp32 global log-sum-exp of the logits. coef: ``[N]`` fp32.
        target_grad: ``[N]`` fp32 (read only where ``target_col_i >= 0``).

    Returns:
        ``grad_e [N, D]`` fp32 ``sum_k G_ik inv_k w_k``; ``grad_w [S, D]`` fp32, the gradient
        w.r.t. the unnormalised rows: ``inv_k (g_k - w_hat_k (w_hat_k . g_k))`` with
        ``g_k = sum_i G_ik e_i``.
    """
    del chunk
    extra = {"lse": lse, "coef": coef, "target_grad": target_grad}
    e, w, inv_norm, target_col, scale, consts = _prepare(e, w, inv_norm, target_col, s, extra)
    lse, coef, target_grad = (t.contiguous() for t in extra.values())
    (n, d), s_cols = e.shape, w.shape[0]
    d_pad = max(16, triton.next_power_of_2(d))
    cfg = _launch(e.device, d_pad, backward=True)
    common = dict(BLOCK_N=cfg.block_n, BLOCK_S=cfg.block_s, BLOCK_D=cfg.block_d, D_PAD=d_pad,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, **consts)
    splits, per = _splits(n, s_cols, cfg)
    grad_e = torch.empty(splits, n, d, dtype=torch.float32, device=e.device)
    _grad_e_kernel[(triton.cdiv(n, cfg.block_n), splits)](
        e, w, inv_norm, target_col, scale, lse, coef, target_grad, grad_e, n, s_cols, d,
        e.stride(0), w.stride(0), per, **common)
    grad_w = torch.empty(s_cols, d, dtype=torch.float32, device=e.device)
    _grad_w_kernel[(triton.cdiv(s_cols, cfg.block_s),)](
        e, w, inv_norm, target_col, scale, lse, coef, target_grad, grad_w, n, s_cols, d,
        e.stride(0), w.stride(0), **common)
    return (grad_e[0] if splits == 1 else grad_e.sum(dim=0)), grad_w
