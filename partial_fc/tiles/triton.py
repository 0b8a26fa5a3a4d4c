"""Triton kernels for the class-tiled margin softmax head: no ``[N, S]`` tensor is ever written.

The ``TileBackend`` of ``partial_fc.tiles`` on CUDA (this module is the back-end), with the
semantics of ``partial_fc.tiles.reference`` (the reference these kernels are tested against);
``docs/kernels.md`` has the design, the FLOP and byte floors and what was verified where.
Notation: ``e [N, D]`` normalised embeddings, ``w [S, D]`` this rank's (sampled) weight rows,
*not* normalised, ``inv_norm [S] = 1 / ||w_k||`` folded into each tile (no normalised copy
of ``w``), ``cos_ik = (e_i . w_k) inv_norm_k`` with fp32 accumulation (arXiv:1801.07698
Eq. 2-3), ``target_col [N]`` the column of row ``i``'s target in ``w`` (``-1``: another rank's
or not sampled).

Forward, ``_stats_kernel``: recomputes ``cos`` tile by tile (as Cut Cross-Entropy does,
arXiv:2411.09009) for an online row max / sum-exp over non-target columns and the non-target
cosine sum; programs run on contiguous class *splits* and leave ``[splits, N]`` partials that a
tiny PyTorch reduction combines (deterministic, no atomics). Backward, per chunk of classes
(one ``G' [N, width]`` buffer of at most 256 MiB, never ``[N, S]``): ``_dcos_kernel`` recomputes
``cos`` and writes ``G' = dL/dcos diag(inv_norm)`` in the operand dtype plus the column sums
``r_k = sum_i dL/dcos_ik cos_ik``; ``_gemm_kernel`` then adds ``G' W_chunk`` to ``grad_e``
(split-K, per-split partials summed in PyTorch) and writes ``grad_w = G'^T E - inv^2 r w``, the
chain rule through ``1 / ||w||`` (``r_k = w_hat_k . g_k``) applied in its epilogue.
The non-target transforms (``partial_fc.nontarget``) are applied in the tiles as the
reference applies them (:func:`_nontarget`; one constexpr each, ``nontarget_constexprs``):
AdaFace's clamp (``CLAMP``), the inter-class filter (``FILTER``, ``tau`` a runtime scalar) and
CurricularFace's hard-negative modulation (``HARD``: per-row thresholds and ``t`` read from
the device, the forward also counting each row's hard negatives), ``s f(cos)`` in the softmax
and ``f'(cos)`` in ``dL/dcos``; the cosine sum and ``r_k`` stay those of the raw cosines.

Operand precision: the dot operands are cast to the narrower of ``e.dtype`` and ``w.dtype``
(bf16 or fp16 when either is, as autocast does; fp32 only when both are, with IEEE fp32 dots
unless ``torch.get_float32_matmul_precision()`` allows TF32, as for ``torch.mm``; IEEE fp32 runs
on CUDA cores, far slower than bf16 (docs/kernels.md), so the fast path is bf16 ``e`` or ``w``);
accumulation, ``exp`` and all outputs are fp32, except ``grad_w`` of a 16-bit ``w`` (in
``w.dtype``, rounded once). In backward ``dL/dcos inv_norm`` is rounded to that operand dtype
before its two matmuls, as autocast's matmul backward rounds its incoming gradient (fp16:
values below 2**-24 underflow, which a GradScaler'd ``coef`` prevents, as in autocast).
Under ``TRITON_INTERPRET=1`` (CPU tensors) 16-bit operands are rounded to their dtype and then
widened to fp32 for ``tl.dot``: triton 3.9's interpreter multiplies bf16 tiles as raw uint16
bits, and its fp32 -> bf16 cast truncates, so bf16 rounding (operands, a bf16 ``grad_w``) is
done there with integer ops (``_operand``). The widening is exact and a product of two 16-bit
floats is exact in fp32, so only the summation order differs from a tensor-core MMA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from partial_fc.nontarget import NonTarget
from partial_fc.tiles import tuning
from partial_fc.tiles.filtered import Skip, live_blocks, operand_dtype

try:
    import triton
    import triton.language as tl
except ImportError as err:  # triton ships with CUDA builds of torch, not with CPU ones
    raise ImportError(
        "partial_fc.tiles.triton needs triton, which is not installed: "
        "pip install triton (it ships with CUDA builds of torch); on CPU use the PyTorch "
        "class-tile path of partial_fc.tiles.reference"
    ) from err

__all__ = ["Tiles", "class_tile_grads", "class_tile_stats", "cuda_tiles", "default_tiles",
           "nontarget_constexprs",
           "operand_constexprs"]

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


@triton.jit
def _gemm_kernel(A, B, OUT, W, W_SCALE, LIVE, M, NC, K, stride_am, stride_ak, stride_bk,
                 stride_bn, stride_os, stride_om, stride_wm, stride_live, k_per_split,
                 BLOCK_M: tl.constexpr, BLOCK_NC: tl.constexpr, BLOCK_K: tl.constexpr,
                 OP: tl.constexpr, DOT: tl.constexpr, SOFT_BF16: tl.constexpr,
                 PRECISION: tl.constexpr, PROJECT: tl.constexpr, ROUND_OUT: tl.constexpr,
                 SKIP: tl.constexpr):
    """Program (M tile, NC tile, K split): ``OUT[split] = A[:, ks] @ B[ks, :]`` in fp32, minus
    ``W_SCALE[:, None] * W`` when ``PROJECT`` (the rank-1 part of the ``1 / ||w||`` chain
    rule, applied in the epilogue); ``ROUND_OUT``: ``OUT`` is 16-bit (the gradient of a bf16
    ``w``, whose dtype is then ``OP``), the fp32 result is rounded to nearest once. ``SKIP``:
    a K step whose ``LIVE[M tile, K step]`` is 0 (its block of ``A`` is zeros: the filtered
    backward) is not loaded or multiplied."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_NC + tl.arange(0, BLOCK_NC)
    split = tl.program_id(2)
    m_ok = rm < M
    n_ok = rn < NC
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_NC), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        live = True
        if SKIP:
            live = tl.load(LIVE + tl.program_id(0) * stride_live + k0 // BLOCK_K) != 0
        if live:
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < k_hi
            a = tl.load(A + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(B + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(_operand(a, OP, DOT, SOFT_BF16), _operand(b, OP, DOT, SOFT_BF16), acc,
                         input_precision=PRECISION)
    mask = m_ok[:, None] & n_ok[None, :]
    if PROJECT:
        w = tl.load(W + rm[:, None] * stride_wm + rn[None, :], mask=mask, other=0.0)
        acc -= tl.load(W_SCALE + rm, mask=m_ok, other=0.0)[:, None] * w.to(tl.float32)
    if ROUND_OUT:
        acc = _operand(acc, OP, DOT, SOFT_BF16)
    tl.store(OUT + split * stride_os + rm[:, None] * stride_om + rn[None, :], acc, mask=mask)


FP_FUSION = True
"""Multiply-adds compiled into FMAs (one rounding instead of two), stated rather than left to
Triton's default: that default is on through Triton 3.9 (which warns at every compile while
it is unset) and off from 3.10, and the kernels' figures (docs/kernels.md) were taken with it on."""


@dataclass(frozen=True)
class Tiles:
    """Tile sizes the kernels launch with (``docs/kernels.md`` has the choices and ptxas'
    register figures; ``make kernels-aot`` prints them without a GPU)."""

    rows: int  # BLOCK_N of a cos tile
    cols: int  # BLOCK_S of a cos tile
    depth: int  # BLOCK_D of the cos dot's D loop, BLOCK_K of the GEMMs
    gemm: int  # BLOCK_M = BLOCK_NC of the GEMMs
    num_warps: int
    num_stages: int
    programs: int  # what the class splits (stats) and K splits (grad_e) aim at: a few per SM
    buffer_bytes: int  # budget of the backward's G' chunk [N, width]
    engine: str = "triton"  # "cublas": torch matmuls per chunk, Triton epilogues (tiles.cublas)

    @property
    def launch_options(self) -> dict:
        """Triton's compile options for each launch (``FP_FUSION`` stated with them)."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages,
                "enable_fp_fusion": FP_FUSION}

    def chunk_width(self, n: int, itemsize: int) -> int:
        """Columns of one backward chunk: whole cos tiles within ``buffer_bytes``, at most
        32768 tiles (a CUDA grid's second dimension stops at 65535)."""
        return min(32768, max(1, self.buffer_bytes // (n * itemsize * self.cols))) * self.cols


def cuda_tiles(sms: int) -> Tiles:
    """The tiles on a CUDA device with ``sms`` multiprocessors."""
    return Tiles(128, 64, 64, 128, num_warps=8, num_stages=3, programs=4 * sms,
                 buffer_bytes=256 << 20)


INTERPRETER_TILES = Tiles(16, 16, 16, 16, num_warps=1, num_stages=1, programs=4,
                          buffer_bytes=8 << 10)
"""Off a GPU (the interpreter): small tiles, so that tests see several splits, chunks and K
splits."""


def default_tiles(e: Tensor) -> Tiles:
    """The configuration chosen before any measurement: :func:`cuda_tiles` on a GPU, the
    interpreter's small tiles off one (``partial_fc.tiles.autotune`` supplies the tuned one)."""
    device = tuning.device_info(e.device)
    return INTERPRETER_TILES if device is None else cuda_tiles(device.sms)


def _splits(parallel: int, items: int, block: int, programs: int) -> tuple[int, int]:
    """``(splits, blocks_per_split)``: cut ``items`` (in blocks of ``block``) into contiguous
    splits so that ``parallel`` x splits reaches ``programs``; no split is empty."""
    blocks = triton.cdiv(items, block)
    want = max(1, min(blocks, triton.cdiv(programs, parallel)))
    per = triton.cdiv(blocks, want)
    return triton.cdiv(blocks, per), per


def _fp32_is_exact() -> bool:
    """fp32 dots in IEEE fp32 unless torch's matmuls may use TF32 (``torch.
    set_float32_matmul_precision("high")``), so the kernels round as ``torch.mm`` would."""
    return torch.get_float32_matmul_precision() == "highest"


def operand_constexprs(e_dtype: torch.dtype, w_dtype: torch.dtype, widen: bool,
                       fp32_exact: bool) -> tuple[torch.dtype, dict]:
    """The operand dtype (the narrower of ``e``'s and ``w``'s) and the dtype constexprs every
    kernel launches with: the one place the launcher chooses them, which
    ``tools/kernels_aot.py`` compiles ahead of time. ``widen``: 16-bit operands rounded, then
    dotted in fp32 (the interpreter, see the module docstring); ``fp32_exact``: IEEE fp32
    dots for fp32 operands, else TF32."""
    op = operand_dtype(e_dtype, w_dtype)
    return op, dict(OP=_TL_DTYPES[op], DOT=tl.float32 if widen else _TL_DTYPES[op],
                    SOFT_BF16=widen and op == torch.bfloat16,
                    PRECISION="ieee" if op == torch.float32 and fp32_exact else "tf32")


def nontarget_constexprs(nontarget: NonTarget | None) -> dict:
    """The kernels' constexprs for the step's non-target transform (``partial_fc.nontarget``),
    the one place the launcher chooses them, which ``tools/kernels_aot.py`` compiles ahead of
    time: ``CLAMP`` AdaFace's ``eps`` (0.0: none), ``FILTER`` the inter-class filter (its
    ``tau`` a runtime argument: one compile for any threshold), ``HARD`` CurricularFace's
    modulation (its thresholds and ``t`` read from the device: no host sync)."""
    if nontarget is None:
        return dict(CLAMP=0.0, FILTER=False, HARD=False)
    if nontarget.clamp is not None and not 0 < nontarget.clamp < 1:
        raise ValueError(f"tiles.triton: clamp={nontarget.clamp}: the kernels clamp to "
                         "[-1 + eps, 1 - eps] with eps in (0, 1)")
    if (nontarget.hard_above is None) != (nontarget.t is None):
        raise ValueError("tiles.triton: CurricularFace's modulation needs both hard_above and "
                         "t (partial_fc.nontarget.NonTarget)")
    return dict(CLAMP=float(nontarget.clamp or 0.0), FILTER=nontarget.tau is not None,
                HARD=nontarget.hard_above is not None)


def _transform(nontarget: NonTarget | None, e: Tensor, scale: Tensor
               ) -> tuple[tuple[Tensor, Tensor, float], dict]:
    """The kernels' runtime arguments of the non-target transform, ``(HARD_ABOVE [N], T [1],
    tau)`` (the scale's tensor stands for the pointers the constexprs leave unread), and its
    constexprs (:func:`nontarget_constexprs`); ``e`` is ``_prepare``'s."""
    consts = nontarget_constexprs(nontarget)
    tau = float(nontarget.tau) if consts["FILTER"] else 0.0
    if not consts["HARD"]:
        return (scale, scale, tau), consts
    vectors = {"hard_above": nontarget.hard_above, "hard_rows": nontarget.hard_rows}
    for name, v in vectors.items():
        if v is not None and (tuple(v.shape) != (e.shape[0],) or v.dtype != torch.float32
                              or v.device != e.device):
            raise ValueError(f"tiles.triton: {name} is {v.dtype} {tuple(v.shape)} on "
                             f"{v.device}, expected float32 ({e.shape[0]},) on {e.device}")
    t = nontarget.t.detach().to(e.device, torch.float32).reshape(1)
    return (nontarget.hard_above.contiguous(), t, tau), consts


def _prepare(e: Tensor, w: Tensor, inv_norm: Tensor, target_col: Tensor, s: Tensor | float,
             extra: dict[str, Tensor]) -> tuple[list[Tensor], Tensor, torch.dtype, dict]:
    """Validate shapes/dtypes/devices. Returns the contiguous ``[e, w, inv_norm, target_col,
    *extra]``, the scale as a 1-element fp32 tensor (no host sync for an AdaCos tensor scale),
    the operand dtype and the kernels' dtype constexprs."""
    if e.dim() != 2 or w.dim() != 2 or e.shape[1] != w.shape[1]:
        raise ValueError(f"tiles.triton: e {tuple(e.shape)} and w {tuple(w.shape)} must be "
                         "[N, D] and [S, D] with the same D")
    n, s_cols = e.shape[0], w.shape[0]
    if n == 0 or s_cols == 0:
        raise ValueError(f"tiles.triton: empty input (N={n}, S={s_cols}); the head never "
                         "calls with no rows or no classes")
    if e.dtype not in _TL_DTYPES or w.dtype not in _TL_DTYPES:
        raise ValueError(f"tiles.triton: e/w dtypes {e.dtype}/{w.dtype}; supported: "
                         "float32, bfloat16, float16")
    narrow = {e.dtype, w.dtype} - {torch.float32}
    if len(narrow) > 1:
        raise ValueError("tiles.triton: e and w mix bfloat16 and float16; cast one of them")
    shapes = {"inv_norm": (inv_norm, (s_cols,), torch.float32),
              "target_col": (target_col, (n,), torch.int64),
              **{k: (v, (n,), torch.float32) for k, v in extra.items()}}
    for name, (t, shape, dtype) in shapes.items():
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"tiles.triton: {name} is {t.dtype} {tuple(t.shape)}, expected "
                             f"{dtype} {shape}")
    tensors = [e, w, inv_norm, target_col, *extra.values()]
    if any(t.device != e.device for t in tensors):
        raise ValueError("tiles.triton: all tensors must be on one device")
    interpret = bool(triton.knobs.runtime.interpret)
    if e.device.type != "cuda" and not interpret:
        raise ValueError(f"tiles.triton: tensors on {e.device} need TRITON_INTERPRET=1 "
                         "(slow, for tests); on CPU use partial_fc.tiles.reference")
    widen = interpret or e.device.type != "cuda"  # see the module docstring
    op, consts = operand_constexprs(e.dtype, w.dtype, widen, _fp32_is_exact())
    # A float becomes a device fill: as_tensor would copy it from the host and wait for it.
    scale = (s.detach().to(e.device, torch.float32).reshape(1) if isinstance(s, Tensor)
             else torch.full((1,), s, dtype=torch.float32, device=e.device))
    return [t.contiguous() for t in tensors], scale, op, consts


def class_tile_stats(e: Tensor, w: Tensor, inv_norm: Tensor, target_col: Tensor,
                     s: Tensor | float, nontarget: NonTarget | None = None,
                     tiles: Tiles | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Row statistics of the non-target logits ``s f(cos_ik)`` of this rank's classes.

    Args:
        e: ``[N, D]`` normalised embeddings (fp32/bf16/fp16). w: ``[S, D]`` weight rows, not
            normalised. inv_norm: ``[S]`` fp32 ``1 / ||w_k||``. target_col: ``[N]`` int64,
            column of row ``i``'s target in ``w`` or ``-1``. s: the scale (float or 0-d tensor).
        nontarget: ``f``: None (the identity) or the step's non-target transform
            (``partial_fc.nontarget``, any of its parts: :func:`_nontarget`); its
            ``hard_rows``, when given, gets each row's count of hard negatives added.
        tiles: the launch configuration, the Triton GEMMs' (a ``"cublas"`` engine runs
            ``partial_fc.tiles.cublas`` instead: ``autotune.TUNED`` picks); None: the
            untuned :func:`default_tiles`.

    Returns:
        ``row_max [N]`` fp32 ``max_k s f(cos_ik)`` (``-inf`` if the row has no non-target
        column), ``row_sum [N]`` fp32 ``sum_k exp(s f(cos_ik) - row_max_i)``, ``cos_sum [N]``
        fp32 ``sum_k cos_ik``; all over non-target columns ``k != target_col_i``.
    """
    (e, w, inv_norm, target_col), scale, _, consts = _prepare(e, w, inv_norm, target_col, s, {})
    (hard_above, t_hard, tau), transform = _transform(nontarget, e, scale)
    (n, d), s_cols = e.shape, w.shape[0]
    t = tiles or default_tiles(e)
    row_blocks = triton.cdiv(n, t.rows)
    splits, per = _splits(row_blocks, s_cols, t.cols, t.programs)
    parts = torch.empty(3 + transform["HARD"], splits, n, dtype=torch.float32, device=e.device)
    max_p, sum_p, cos_p, hard_p = parts[0], parts[1], parts[2], parts[-1]
    _stats_kernel[(row_blocks, splits)](
        e, w, inv_norm, target_col, scale, hard_above, t_hard, max_p, sum_p, cos_p, hard_p,
        n, s_cols, d, e.stride(0), w.stride(0), per, tau, BLOCK_N=t.rows, BLOCK_S=t.cols,
        BLOCK_D=t.depth, **transform, **t.launch_options, **consts)
    if transform["HARD"] and nontarget.hard_rows is not None:
        nontarget.hard_rows.add_(hard_p.sum(dim=0))
    row_max = max_p.amax(dim=0)
    shift = torch.where(torch.isinf(row_max), 0.0, row_max)  # all splits empty -> sum 0
    row_sum = (sum_p * torch.exp(max_p - shift)).sum(dim=0)
    return row_max, row_sum, cos_p.sum(dim=0)


def class_tile_grads(e: Tensor, w: Tensor, inv_norm: Tensor, target_col: Tensor,
                     s: Tensor | float, lse: Tensor, coef: Tensor, target_grad: Tensor,
                     nontarget: NonTarget | None = None, tiles: Tiles | None = None,
                     skip: Skip | None = None) -> tuple[Tensor, Tensor]:
    """Gradients of the loss through the cosines, recomputing the ``cos`` tiles.

    With ``G_ik = dL/dcos_ik``: ``coef_i exp(s f(cos_ik) - lse_i) f'(cos_ik)`` for
    ``k != target_col_i`` (``f`` as in :func:`class_tile_stats`) and
    ``target_grad_i`` at ``k = target_col_i``. Per chunk of classes (a ``G' = G diag(inv)``
    buffer of at most 256 MiB in the operand dtype; ``[N, S]`` is never allocated):
    ``_dcos_kernel`` writes ``G'`` and ``r_k = sum_i G_ik cos_ik``; a split-K GEMM adds
    ``G' W_chunk`` to ``grad_e``; a GEMM writes ``grad_w = G'^T E - inv^2 r w`` (the
    normalisation chain rule: ``r_k = w_hat_k . g_k``).

    Args:
        e, w, inv_norm, target_col, s, nontarget, tiles: as in ``class_tile_stats``.
        lse: ``[N]`` fp32 global log-sum-exp of the logits. coef: ``[N]`` fp32.
        target_grad: ``[N]`` fp32 (read only where ``target_col_i >= 0``).
        skip: None (exact, the default) or the filtered backward
            (``partial_fc.tiles.filtered``): a ``(row block, class tile)`` whose every
            ``|G_ik|`` is below ``skip.below_i`` counts as zeros and the GEMMs skip it;
            plain non-target logits only (no ``nontarget``: the bound assumes ``f' = 1``).

    Returns:
        ``grad_e [N, D]`` fp32 ``sum_k G_ik inv_k w_k``; ``grad_w [S, D]`` in ``w.dtype``
        (fp32 accumulation, a bf16 ``w``'s gradient rounded once in the epilogue), the
        gradient w.r.t. the unnormalised rows: ``inv_k (g_k - w_hat_k (w_hat_k . g_k))`` with
        ``g_k = sum_i G_ik e_i``.
    """
    extra = {"lse": lse, "coef": coef, "target_grad": target_grad}
    if skip is not None:
        extra["skip.below"] = skip.below
    tensors, scale, op, consts = _prepare(e, w, inv_norm, target_col, s, extra)
    e, w, inv_norm, target_col, lse, coef, target_grad = tensors[:7]
    below = tensors[7] if skip is not None else scale  # unread without SKIP
    (hard_above, t_hard, tau), transform = _transform(nontarget, e, scale)
    if skip is not None and any(transform.values()):
        raise ValueError("tiles.triton: skip (the filtered backward) bounds plain non-target "
                         "logits only; this step has a non-target transform (nontarget)")
    (n, d), s_cols = e.shape, w.shape[0]
    t = tiles or default_tiles(e)
    row_blocks = triton.cdiv(n, t.rows)
    width_max = min(s_cols, t.chunk_width(n, op.itemsize))
    buffer = torch.empty(n, width_max, dtype=op, device=e.device)  # G' of one chunk
    radial = torch.empty(row_blocks, width_max, dtype=torch.float32, device=e.device)
    live = torch.empty(row_blocks, triton.cdiv(width_max, t.cols), dtype=torch.int32,
                       device=e.device) if skip is not None else scale  # unread without SKIP
    out_tiles = triton.cdiv(n, t.gemm) * triton.cdiv(d, t.gemm)
    grad_e = torch.zeros(n, d, dtype=torch.float32, device=e.device)
    grad_w = torch.empty(s_cols, d, dtype=w.dtype, device=e.device)
    gemm = dict(BLOCK_M=t.gemm, BLOCK_NC=t.gemm, BLOCK_K=t.depth, SKIP=skip is not None,
                **t.launch_options, **consts)
    for col0 in range(0, s_cols, width_max):
        width = min(width_max, s_cols - col0)
        g, w_c, r = buffer[:, :width], w[col0:col0 + width], radial[:, :width]
        col_tiles = triton.cdiv(width, t.cols)
        _dcos_kernel[(row_blocks, col_tiles)](
            e, w, inv_norm, target_col, scale, hard_above, t_hard, lse, coef, target_grad, g, r,
            below, live, n, d, e.stride(0), w.stride(0), g.stride(0), r.stride(0),
            live.stride(0), col0, width, tau, BLOCK_N=t.rows, BLOCK_S=t.cols, BLOCK_D=t.depth,
            SKIP=skip is not None, **transform, **t.launch_options, **consts)
        live_e = live_w = scale  # unread without SKIP
        if skip is not None:
            kept = live[:, :col_tiles]
            if skip.tiles is not None:
                skip.tiles[0] += (kept == 0).sum()
                skip.tiles[1] += kept.numel()
            # grad_e's M tiles are rows and its K steps classes; grad_w's the other way round
            live_e = live_blocks(kept, (t.rows, t.gemm), (t.cols, t.depth),
                                 (triton.cdiv(n, t.gemm), triton.cdiv(width, t.depth)))
            live_w = live_blocks(kept.t(), (t.cols, t.gemm), (t.rows, t.depth),
                                 (triton.cdiv(width, t.gemm), triton.cdiv(n, t.depth)))
        splits, per = _splits(out_tiles, width, t.depth, t.programs)  # split-K over classes
        part = torch.empty(splits, n, d, dtype=torch.float32, device=e.device)
        _gemm_kernel[(triton.cdiv(n, t.gemm), triton.cdiv(d, t.gemm), splits)](
            g, w_c, part, w_c, inv_norm, live_e, n, d, width, g.stride(0), 1, w_c.stride(0), 1,
            part.stride(0), part.stride(1), 0, live_e.stride(0), per * t.depth, PROJECT=False,
            ROUND_OUT=False, **gemm)
        grad_e += part.sum(dim=0)
        project = inv_norm[col0:col0 + width].square() * r.sum(dim=0)
        out = grad_w[col0:col0 + width]
        _gemm_kernel[(triton.cdiv(width, t.gemm), triton.cdiv(d, t.gemm), 1)](
            g, e, out, w_c, project, live_w, width, d, n, 1, g.stride(0), e.stride(0), 1,
            0, out.stride(0), w_c.stride(0), live_w.stride(0), n, PROJECT=True,
            ROUND_OUT=w.dtype != torch.float32, **gemm)
    return grad_e, grad_w
