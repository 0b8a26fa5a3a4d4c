"""Transforms of the non-target cosines: ``z_ik = s * f_i(cos_ik)`` for ``k != y_i``.

Most margins touch the target logit only; three features change the others too, so the class
tiles apply them column by column (``partial_fc.tiles.reference`` with :meth:`NonTarget.apply`;
the Triton kernels of ``partial_fc.tiles.triton`` with the same operations, each part a
constexpr):

- CurricularFace's hard-negative modulation (arXiv:2004.00288 Eq. 6-7):
  ``f_i(c) = c (t + c)`` where ``c > cos(theta_{y_i} + m)`` (a *hard* negative of row ``i``),
  else ``c``; ``t`` is the EMA of the global batch's mean target cosine, a constant of the
  step (no gradient flows to it or to the per-row threshold, as in the paper's code).
- arcface_torch's inter-class filter (``interclass_filtering_threshold`` of its
  ``losses.py``): ``f(c) = 0`` where ``c > tau`` (the logit becomes ``s * 0``, still in the
  denominator, with no gradient), else ``c``. It screens out the classes a noisy sample's
  feature is closest to besides its label, on every shard.

- AdaFace's clamp (its authors' ``head.py``): ``f(c) = clamp(c, -1 + eps, 1 - eps)``, zero
  gradient past the band.

When several are set the clamp applies first, then the filter:
``f = curricular(filter(clamp(c)))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["NonTarget"]


@dataclass(frozen=True)
class NonTarget:
    """Elementwise ``f_i`` of one step on ``[N, chunk]`` cosine tiles (``N``: the global batch).

    ``hard_above`` ``[N]`` fp32: row ``i``'s hard-negative threshold ``cos(theta_y + m)``
    and ``t`` (0-d fp32) its modulation, both or neither (CurricularFace); ``tau``: the
    inter-class filter's threshold or None. ``hard_rows`` ``[N]`` fp32, when given, is an
    output: the forward statistics pass adds each row's hard negatives to it (the
    hard-negative share that CurricularFace reports). ``clamp``: the ``eps`` of AdaFace's
    clamp to ``[-1 + eps, 1 - eps]``, or None.
    """

    hard_above: Tensor | None = None
    t: Tensor | None = None
    tau: float | None = None
    hard_rows: Tensor | None = None
    clamp: float | None = None

    def apply(self, cos: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(f(cos), f'(cos), hard)`` for an ``[N, chunk]`` tile (every row, some classes);
        ``hard`` the bool mask of the hard negatives (None without CurricularFace)."""
        out, slope, hard = cos, torch.ones_like(cos), None
        if self.clamp is not None:
            inside = (cos >= -1 + self.clamp) & (cos <= 1 - self.clamp)
            out = cos.clamp(-1 + self.clamp, 1 - self.clamp)
            slope = inside.to(cos.dtype)
        if self.tau is not None:
            dirty = cos > self.tau
            out = torch.where(dirty, 0.0, out)
            slope = torch.where(dirty, 0.0, slope)
        if self.hard_above is not None:
            hard = out > self.hard_above[:, None]
            slope = torch.where(hard, slope * (self.t + 2 * out), slope)
            out = torch.where(hard, out * (self.t + out), out)
        return out, slope, hard
