"""Tolerances of 16-bit results, from the format: how far apart two bf16 or fp16 results of
the same computation may honestly lie.

A format with ``p`` significand bits (bf16 8, fp16 11, fp32 24) spaces its numbers in
``[2^k, 2^(k+1))`` one ulp apart, ``ulp = eps * 2^k`` (``eps = torch.finfo(dtype).eps``:
bf16 ``2^-7``, fp16 ``2^-10``); rounding to nearest lands within half an ulp of the value
rounded (the unit roundoff ``u = eps / 2``, ``partial_fc.tiles.filtered.unit_roundoff``).

Two results of the same quantity that sum in fp32 in different orders (another kernel:
oneDNN and ATen pick their kernels, and so their summation orders, by the instruction set of
the CPU they find) and then round once to a 16-bit format differ by the difference of their
fp32 sums (the fp32 comparison's own tolerance, unchanged: ``normwise`` of the largest
value) plus, where a boundary between two 16-bit numbers lies between those sums, one ulp at
the value. A fixed 1e-5 on such results held only while no result near the largest one
straddled a boundary: on one CPU, not on another (``test_tuning``'s bf16 ``grad_w``, 1.26e-5
on an AVX-512 BF16 Xeon). Each further rounding of the same kind (``roundings``) adds one ulp.
"""

from __future__ import annotations

import torch
from torch import Tensor

HALF = (torch.bfloat16, torch.float16)


def ulp(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The spacing of ``dtype``'s numbers at each ``|x|`` (float64): ``eps * 2^k`` for ``|x|``
    in ``[2^k, 2^(k+1))``, the subnormals' spacing below the smallest normal number."""
    info = torch.finfo(dtype)
    magnitude = x.detach().double().abs().clamp_min(info.smallest_normal)
    _, exponent = torch.frexp(magnitude)  # magnitude = m 2^exponent, m in [0.5, 1)
    return info.eps * torch.pow(2.0, exponent.double() - 1)


def rounding_excess(got: Tensor, want: Tensor, normwise: float = 1e-5, roundings: int = 1,
                    dtype: torch.dtype | None = None) -> float:
    """The largest ``|got - want|`` as a fraction of what the two may differ by (pass: ``<=
    1``): ``normwise * max|want|`` (the fp32 sums' order) plus, for results in a 16-bit
    ``dtype`` (the tensors' own unless given), ``roundings`` ulps at ``max(|got|, |want|)``.
    fp32 results get ``normwise`` alone: the comparison they had. A non-finite entry of
    ``want`` must be matched exactly; ``inf`` otherwise, or on a shape mismatch."""
    dtype = dtype or (got.dtype if got.dtype in HALF else want.dtype)
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return float("inf")
    finite = torch.isfinite(want)
    if not torch.equal(got[~finite], want[~finite]) or not torch.isfinite(got[finite]).all():
        return float("inf")
    got, want = got[finite], want[finite]
    if want.numel() == 0:
        return 0.0
    allowed = normwise * want.abs().max() + torch.zeros_like(want)
    if dtype in HALF:
        allowed = allowed + roundings * ulp(torch.maximum(got.abs(), want.abs()), dtype)
    return float(((got - want).abs() / allowed.clamp_min(1e-300)).max())
