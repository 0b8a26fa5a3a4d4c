"""The tile operations every Triton kernel shares (``partial_fc.tiles.triton``'s and the
epilogues of ``partial_fc.tiles.cublas``): operand rounding, a ``cos`` tile, the non-target
transform, a tile's ``dL/dcos`` and the step's CurricularFace constants.

The non-target transforms (``partial_fc.nontarget``) are applied in the tiles as the reference
applies them (:func:`_nontarget`; one constexpr each, ``nontarget_constexprs``): AdaFace's clamp
(``CLAMP``), the inter-class filter (``FILTER``, ``tau`` a runtime scalar) and CurricularFace's
hard-negative modulation (``HARD``: per-row thresholds and ``t`` read from the device, the
forward also counting each row's hard negatives), ``s f(cos)`` in the softmax and ``f'(cos)``
in ``dL/dcos``; the cosine sum and ``r_k`` stay those of the raw cosines.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _nontarget(cos, hard_above, t, tau, CLAMP: tl.constexpr, FILTER: tl.constexpr,
               HARD: tl.constexpr):
    """``(f(cos), f'(cos), hard)`` of the step's non-target transform, in the order of
    ``partial_fc.nontarget``: AdaFace's clamp to ``[-1 + CLAMP, 1 - CLAMP]`` (``CLAMP > 0``;
    slope 0 past the band, 1 inside it, bounds included), then the inter-class filter
    (``FILTER``: ``f = 0``, ``f' = 0`` where the raw ``cos > tau``), then CurricularFace's
    modulation (``HARD``: ``f = c (t + c)``, ``f' = f'_c (t + 2 c)`` where the transformed
    ``c > hard_above`` ``[BLOCK_N]``, the row's ``cos(theta_y + m)``; ``t`` and the threshold
    are constants of the step, as the reference). ``hard``: the bool mask of those hard
    negatives (all False without ``HARD``). Each constexpr off compiles its part away; the
    plain slope is the constant 1."""
    out = cos
    slope = 1.0
    if CLAMP > 0:
        out = tl.minimum(tl.maximum(cos, -1.0 + CLAMP), 1.0 - CLAMP)
        slope = tl.where((cos >= -1.0 + CLAMP) & (cos <= 1.0 - CLAMP), 1.0, 0.0)
    if FILTER:
        dirty = cos > tau
        out = tl.where(dirty, 0.0, out)
        slope = tl.where(dirty, 0.0, slope)
    hard = cos != cos
    if HARD:
        hard = out > hard_above[:, None]
        slope = tl.where(hard, slope * (t + 2.0 * out), slope)
        out = tl.where(hard, out * (t + out), out)
    return out, slope, hard


@triton.jit
def _dcos_tile(cos, cols, col_ok, tgt, s, lse, coef, tgrad, hard_above, t, tau,
               CLAMP: tl.constexpr, FILTER: tl.constexpr, HARD: tl.constexpr):
    """``dL/dcos`` of a tile: ``coef_i exp(s f(cos_ik) - lse_i) f'(cos_ik)`` off target (``f``:
    :func:`_nontarget`), ``tgrad_i`` on it, 0 on masked columns (masked rows carry
    ``coef = tgrad = 0``, ``tgt = -1``)."""
    f, slope, _ = _nontarget(cos, hard_above, t, tau, CLAMP, FILTER, HARD)
    g = tl.where(col_ok[None, :], coef[:, None] * tl.exp(s * f - lse[:, None]) * slope, 0.0)
    return tl.where(cols[None, :] == tgt[:, None], tgrad[:, None], g)


@triton.jit
def _step_constants(HARD_ABOVE, T, rows, row_ok, HARD: tl.constexpr):
    """CurricularFace's per-row thresholds ``[BLOCK_N]`` and ``t`` for :func:`_nontarget`
    (zeros, unread, without ``HARD``)."""
    if HARD:
        return tl.load(HARD_ABOVE + rows, mask=row_ok, other=0.0), tl.load(T)
    else:
        return tl.zeros(rows.shape, tl.float32), 0.0
