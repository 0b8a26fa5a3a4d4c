"""Triton kernels for the class-tiled margin softmax head: no ``[N, S]`` tensor is ever written.

The ``TileBackend`` of ``partial_fc.tiles`` on CUDA (this module is the back-end), with the
semantics of ``partial_fc.tiles.reference`` (the reference these kernels are tested against);
``docs/kernels.md`` has the design, the FLOP and byte floors and what was verified where.
Notation: ``e [N, D]`` normalised embeddings, ``w [S, D]`` this rank's (sampled) weight rows,
*not* normalised, ``inv_norm [S] = 1 / ||w_k||`` folded into each tile (no normalised copy
of ``w``), ``cos_ik = (e_i . w_k) inv_norm_k`` with fp32 accumulation (arXiv:1801.07698
Eq. 2-3), ``target_col [N]`` the column of row ``i``'s target in ``w`` (``-1``: another rank's
or not sampled).

Forward: ``_stats_kernel`` (``triton_kernels.forward``) leaves ``[splits, N]`` partials of
each row's non-target max, sum-exp and cosine sum, which a tiny PyTorch reduction here combines.
Backward, per chunk of classes (one ``G' [N, width]`` buffer of at most 256 MiB, never
``[N, S]``): ``_dcos_kernel`` (``triton_kernels.dcos``) writes ``G' = dL/dcos diag(inv_norm)``
and the column sums ``r_k``; ``_gemm_kernel`` (``triton_kernels.gemm``) then adds ``G' W_chunk``
to ``grad_e`` and writes ``grad_w``. The tile operations they share, the non-target transforms
included, are in ``triton_kernels.tile_ops``; this module chooses the kernels' constexprs,
validates the inputs and launches them.

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
done there with integer ops (``tile_ops._operand``). The widening is exact and a product of two
16-bit floats is exact in fp32, so only the summation order differs from a tensor-core MMA.
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

# The kernels import triton themselves: after the guard above, which names the fix.
from partial_fc.tiles.triton_kernels.dcos import _dcos_kernel
from partial_fc.tiles.triton_kernels.forward import _stats_kernel
from partial_fc.tiles.triton_kernels.gemm import _gemm_kernel

__all__ = ["Tiles", "class_tile_grads", "class_tile_stats", "cuda_tiles", "default_tiles",
           "nontarget_constexprs",
           "operand_constexprs"]

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


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
