"""The class-tile passes of the margin softmax head in PyTorch, chunked over classes.

The ``TileBackend`` of ``partial_fc.tiles`` that the Triton kernels (``partial_fc.tiles.triton``)
are tested against, and the CPU path: ``e [N, D]`` normalised embeddings, ``w [S, D]`` this rank's
(sampled) weight rows, *not* normalised, ``inv_norm [S] = 1 / ||w_k||`` folded into each chunk
(no normalised copy of ``w``), ``cos_ik = (e_i . w_k) inv_norm_k`` (arXiv:1801.07698 Eq. 2-3),
``target_col [N]`` the column of row ``i``'s target in ``w`` (``-1``: not in this shard).
With ``subcenters = K > 1`` (sub-center ArcFace, ``partial_fc.subcenters``) ``w`` holds ``K``
rows per class, class-major, and a column is a class: ``cos_ij = max_k cos(e_i, w_jk)``.

The classes are swept ``chunk`` columns at a time, so at most two ``[N, chunk]`` fp32
buffers are alive (plus ``[N, D]`` and the ``[S, D]`` output): the forward keeps an online
row max / sum-exp (Milakov & Gimelshein 2018) and the backward recomputes each chunk's cosines
(as Cut Cross-Entropy does, arXiv:2411.09009) instead of keeping ``[N, S]`` logits. Matmul
operands are rounded to the narrower of ``e.dtype`` and ``w.dtype`` (as autocast picks) and
multiplied in fp32; ``exp`` and every output are fp32 except ``grad_w``, which is in
``w.dtype`` (a bf16 weight's gradient, rounded once from the fp32 chunk: no fp32 ``[S, D]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from partial_fc.nontarget import NonTarget
from partial_fc.subcenters import best_of, spread

__all__ = ["ReferenceTiles", "chunk_columns"]


def chunk_columns(n: int, max_tile_bytes: int) -> int:
    """Columns of one fp32 ``[n, chunk]`` tile within ``max_tile_bytes`` (at least 1)."""
    return max(1, max_tile_bytes // (4 * max(n, 1)))


def _operands(e: Tensor, w: Tensor) -> tuple[Tensor, torch.dtype]:
    """``e`` rounded to the operand dtype and widened to fp32 (exact), and that dtype: a 16-bit
    matmul in PyTorch rounds its *output* to 16 bits, so the products run in fp32 on operands
    rounded as the kernels round them."""
    if e.dim() != 2 or w.dim() != 2 or e.shape[1] != w.shape[1]:
        raise ValueError(f"tiles.reference: e {tuple(e.shape)} and w {tuple(w.shape)} need "
                         "the same D")
    op = w.dtype if e.dtype == torch.float32 else e.dtype
    return e.to(op).float(), op


def _cos_chunk(e_f: Tensor, w: Tensor, op: torch.dtype, inv_norm: Tensor, a: int,
               b: int) -> tuple[Tensor, Tensor]:
    """fp32 ``cos [N, b - a]`` of columns ``a:b`` (a fresh buffer, free to modify) and those
    rows of ``w`` as the matmul saw them (fp32)."""
    w_f = w[a:b].to(op).float()
    return (e_f @ w_f.t()).mul_(inv_norm[a:b]), w_f


def _put_targets(x: Tensor, target_col: Tensor, a: int, values: Tensor | float) -> None:
    """``x[i, target_col_i - a] = values_i`` for the rows whose target lies in this chunk
    (columns ``a : a + x.shape[1]``), in place; the other rows keep their values. One gather
    and one scatter of a column per row: selecting the rows instead would give a shape that
    depends on the labels, which on CUDA makes the host wait for the device."""
    col = target_col - a
    hit = (col >= 0) & (col < x.shape[1])
    col = col.clamp(0, x.shape[1] - 1)[:, None]
    x.scatter_(1, col, torch.where(hit, values, x.gather(1, col)[:, 0])[:, None])


@dataclass(frozen=True)
class ReferenceTiles:
    """The class-tile passes in PyTorch, ``chunk_columns(N, max_tile_bytes)`` columns at a time
    (classes: ``1 / subcenters`` of that, at least 1)."""

    max_tile_bytes: int
    subcenters: int = 1

    def class_tile_stats(self, e: Tensor, w: Tensor, inv_norm: Tensor, target_col: Tensor,
                         s: Tensor | float, nontarget: NonTarget | None = None
                         ) -> tuple[Tensor, Tensor, Tensor]:
        """Over the non-target columns of each row: ``row_max = max_k s f(cos_ik)`` (``-inf`` if
        none), ``row_sum = sum_k exp(s f(cos_ik) - row_max_i)`` and ``cos_sum = sum_k cos_ik``,
        ``[N]`` fp32, with ``f`` the identity or ``nontarget`` (``partial_fc.nontarget``),
        whose ``hard_rows``, when given, gets each row's hard negatives added. ``s`` is a
        float or a 0-d tensor."""
        with torch.no_grad(), torch.autocast(e.device.type, enabled=False):  # fp32 products
            return _stats(e, w, inv_norm, target_col, s, self._chunk(e), self.subcenters,
                          nontarget)

    def class_tile_grads(self, e: Tensor, w: Tensor, inv_norm: Tensor, target_col: Tensor,
                         s: Tensor | float, lse: Tensor, coef: Tensor, target_grad: Tensor,
                         nontarget: NonTarget | None = None) -> tuple[Tensor, Tensor]:
        """Gradients from ``G_ik = dL/dcos_ik = coef_i exp(s f(cos_ik) - lse_i) f'(cos_ik)``
        off target (``f`` as in :meth:`class_tile_stats`) and
        ``target_grad_i`` at ``k = target_col_i``: ``grad_e = G diag(inv) W`` ``[N, D]`` fp32
        and, w.r.t. the *unnormalised* rows, ``grad_w_k = inv_k (g_k - w_hat_k (w_hat_k . g_k))``
        with ``g = G^T E`` ``[S, D]`` in ``w.dtype`` (computed in fp32 per chunk, rounded once).
        ``w_hat_k . g_k = sum_i G_ik cos_ik`` (``r_k``), so the projection costs one column sum
        per chunk."""
        with torch.no_grad(), torch.autocast(e.device.type, enabled=False):
            return _grads(e, w, inv_norm, target_col, s, lse, coef, target_grad, self._chunk(e),
                          self.subcenters, nontarget)

    def _chunk(self, e: Tensor) -> int:
        return max(1, chunk_columns(e.shape[0], self.max_tile_bytes) // self.subcenters)


def _stats(e, w, inv_norm, target_col, s, chunk, k, nontarget):
    e_f, op = _operands(e, w)
    n, cols = e.shape[0], w.shape[0] // k
    s = s.float() if isinstance(s, Tensor) else float(s)
    row_max = torch.full((n,), -torch.inf, device=e.device)
    row_sum = torch.zeros(n, device=e.device)
    cos_sum = torch.zeros(n, device=e.device)
    for a in range(0, cols, chunk):
        b = min(a + chunk, cols)
        cos, _ = _cos_chunk(e_f, w, op, inv_norm, a * k, b * k)
        if k > 1:
            cos, _ = best_of(cos, k)
        _put_targets(cos, target_col, a, 0.0)
        cos_sum += cos.sum(dim=1)
        if nontarget is not None:
            cos = _nontarget_stats(nontarget, cos, target_col, a)
        z = cos.mul_(s)
        _put_targets(z, target_col, a, -torch.inf)
        new_max = torch.maximum(row_max, z.amax(dim=1))
        safe = torch.where(torch.isinf(new_max), 0.0, new_max)  # rows with no column yet
        row_sum.mul_(torch.exp(row_max - safe)).add_(z.sub_(safe[:, None]).exp_().sum(dim=1))
        row_max = new_max
    return row_max, row_sum, cos_sum


def _nontarget_stats(nontarget: NonTarget, cos: Tensor, target_col: Tensor, a: int) -> Tensor:
    """``f(cos)`` of a forward chunk; its hard negatives (the target column excluded) are
    added to ``nontarget.hard_rows`` when that is given."""
    out, _, hard = nontarget.apply(cos)
    if hard is not None and nontarget.hard_rows is not None:
        count = hard.float()
        _put_targets(count, target_col, a, 0.0)
        nontarget.hard_rows.add_(count.sum(dim=1))
    return out


def _grads(e, w, inv_norm, target_col, s, lse, coef, target_grad, chunk, k, nontarget):
    e_f, op = _operands(e, w)
    cols = w.shape[0] // k
    s = s.float() if isinstance(s, Tensor) else float(s)
    grad_e = torch.zeros(e.shape, dtype=torch.float32, device=e.device)
    grad_w = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    lse, coef = lse.float()[:, None], coef.float()[:, None]
    ones = torch.ones(e.shape[0], device=e.device)  # column sums as a GEMV, below
    for a in range(0, cols, chunk):
        # One call per chunk: its tiles are freed when it returns. Were the body inline, the
        # last chunk's G would still be bound while the next one is built, three tiles at the
        # peak where partial_fc.memory counts two (bench/cuda_peak.py, H200, 2026-11-27).
        _grad_chunk(e_f, w, op, inv_norm, target_col, s, lse, coef, target_grad, k, nontarget,
                    ones, a, min(a + chunk, cols), grad_e, grad_w)
    return grad_e, grad_w


def _grad_chunk(e_f, w, op, inv_norm, target_col, s, lse, coef, target_grad, k, nontarget,
                ones, a, b, grad_e, grad_w) -> None:
    """Classes ``a:b`` of :func:`_grads`: their rows of ``grad_w`` written, ``grad_e`` added to."""
    lo, hi = a * k, b * k  # the rows of classes a:b
    cos, w_f = _cos_chunk(e_f, w, op, inv_norm, lo, hi)
    best, arg = best_of(cos, k) if k > 1 else (cos, None)
    if nontarget is None:
        g = (best * s).sub_(lse).exp_().mul_(coef)
    else:
        f, slope, _ = nontarget.apply(best)
        g = (f * s).sub_(lse).exp_().mul_(coef).mul_(slope)
        del f, slope
    _put_targets(g, target_col, a, target_grad.float())
    if k > 1:  # each class's gradient to its argmax centre
        g = spread(g, arg, k)
    # [hi - lo]: w_hat_k . g_k (cos is not needed any more). A GEMV, not sum(dim=0): on CUDA
    # that sum held two tiles' worth of temporaries at the head's peak (bench/cuda_peak.py,
    # H200, 2026-11-27); the GEMV needs none.
    r = torch.mv(cos.mul_(g).t(), ones)
    del cos, best
    inv = inv_norm[lo:hi]
    wide = w.dtype == torch.float32
    # fp32 w: written in place (no [chunk, D] temporary); bf16: an fp32 chunk, rounded once
    out = grad_w[lo:hi] if wide else torch.empty(hi - lo, w.shape[1], device=w.device)
    torch.mm(g.t(), e_f, out=out)
    w_st = w_f if w.dtype == op else w[lo:hi].float()  # the rows as stored (not rounded)
    out.mul_(inv[:, None]).addcmul_(w_st, (inv * inv * r)[:, None], value=-1.0)
    if not wide:
        grad_w[lo:hi] = out
    grad_e.addmm_(g.mul_(inv), w_f)
