"""The backward's GEMM kernel, ``_gemm_kernel``: ``grad_e`` and the weight gradient.

Launched twice per chunk of classes by ``partial_fc.tiles.triton.class_tile_grads``: it adds
``G' W_chunk`` to ``grad_e`` (split-K, per-split partials summed in PyTorch) and writes
``grad_w = G'^T E - inv^2 r w``, the chain rule through ``1 / ||w||`` (``r_k = w_hat_k . g_k``)
applied in its epilogue.
"""

from __future__ import annotations

import triton
import triton.language as tl

from partial_fc.tiles.triton_kernels.tile_ops import _operand


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
