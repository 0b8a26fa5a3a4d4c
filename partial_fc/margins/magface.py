"""MagFace (Meng et al., arXiv:2103.06627): a margin growing with the feature norm, and a
regulariser on the norm."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from partial_fc import metric_names as names
from partial_fc.margins.base import Margin, Scale, acos, spread
from partial_fc.margins.keys import Error, MarginSpec, error, key
from partial_fc.margins.step import MarginBatch, MarginStep

__all__ = ["MAGFACE", "MagFaceMargin"]


@dataclass(frozen=True)
class MagFaceConfig:
    l_a: float = key(10.0, "lower bound of the feature norm", gt=0)
    u_a: float = key(110.0, "upper bound of the feature norm", gt=0)
    l_m: float = key(0.45, "the margin at norm l_a (radians)", ge=0, lt=math.pi)
    u_m: float = key(0.8, "the margin at norm u_a (radians)", ge=0, lt=math.pi)
    lambda_g: float = key(35.0, "weight of the norm regulariser", ge=0)
    easy_margin: bool = key(True, "the authors' MagLinear default: a target cosine <= 0 keeps "
                            "cos(theta), no margin; false: past pi - m(a) the penalty "
                            "cos(theta) - m(a) sin(m(a))")

    def errors(self) -> list[Error]:
        out = []
        if not self.l_a < self.u_a:
            out.append(error("u_a", self.u_a, f"MagFace needs 0 < l_a < u_a (l_a={self.l_a})"))
        if not self.l_m <= self.u_m:
            out.append(error("u_m", self.u_m, f"MagFace needs 0 <= l_m <= u_m < pi "
                             f"(l_m={self.l_m})"))
        return out


class MagFaceMargin(Margin):
    """MagFace (arXiv:2103.06627 Eq. 3-5): with ``a_i = ||f_i||`` clamped to ``[l_a, u_a]``
    (gradient flows inside), the margin ``m(a) = (u_m - l_m) / (u_a - l_a) (a - l_a) + l_m``
    and ``psi = cos(theta + m(a))``; the loss adds ``lambda_g * mean_i g(a_i)``,
    ``g(a) = a / u_a^2 + 1 / a`` (Eq. 4), averaged over the *global* batch. Both the margin
    and the regulariser pass their gradient to the norm.

    Where ``cos(theta + m(a))`` is not applied, as the authors' ``MagLinear``
    (IrvingMeng/MagFace ``models/magface.py``): with ``easy_margin`` (its default, which the
    released models trained with) ``psi = cos(theta)`` where ``cos(theta) <= 0``; without it
    ``psi = cos(theta) - m(a) sin(pi - m(a))`` past ``theta = pi - m(a)``.
    """

    needs_norms = True

    def __init__(self, scale: Scale, l_a: float = 10.0, u_a: float = 110.0, l_m: float = 0.45,
                 u_m: float = 0.8, lambda_g: float = 35.0, easy_margin: bool = True,
                 warmup_steps: int = 0) -> None:
        super().__init__(scale, warmup_steps)
        self.l_a, self.u_a, self.l_m, self.u_m = float(l_a), float(u_a), float(l_m), float(u_m)
        self.lambda_g, self.easy_margin = float(lambda_g), bool(easy_margin)

    def margin_of(self, a: Tensor) -> Tensor:
        """Eq. 3's ``m(a)`` of norms already clamped to ``[l_a, u_a]``."""
        return (self.u_m - self.l_m) / (self.u_a - self.l_a) * (a - self.l_a) + self.l_m

    def statistic(self, batch: MarginBatch) -> int:
        """The number of samples the regulariser is averaged over."""
        return batch.target_cos.numel()

    def prepare(self, batch: MarginBatch) -> MarginStep:
        norms = batch.norms.float()

        def psi(c: Tensor, aux: Tensor | None) -> Tensor:
            m = self.margin_of(aux.clamp(self.l_a, self.u_a))
            c = c.float()
            out = torch.cos(acos(c) + m)
            if self.easy_margin:
                return torch.where(c > 0, out, c)
            return torch.where(c > torch.cos(math.pi - m), out, c - torch.sin(math.pi - m) * m)

        own = norms[batch.rows].clamp(self.l_a, self.u_a)
        penalty = self.lambda_g * (own / self.u_a ** 2 + 1.0 / own).sum() / self.statistic(batch)
        moments = spread(norms.detach())
        stats = {names.NORM_MEAN: moments["mean"], names.NORM_STD: moments["std"],
                 names.NORM_MIN: norms.detach().min(), names.NORM_MAX: norms.detach().max()}
        return MarginStep(psi=psi, aux=norms, penalty=penalty, stats=stats)

    def extra_repr(self) -> str:
        return (f"l_a={self.l_a}, u_a={self.u_a}, l_m={self.l_m}, u_m={self.u_m}, "
                f"lambda_g={self.lambda_g}, easy_margin={self.easy_margin}")


MAGFACE = MarginSpec(
    "magface", MagFaceConfig,
    lambda c, scale, w: MagFaceMargin(scale, c.l_a, c.u_a, c.l_m, c.u_m, c.lambda_g,
                                      c.easy_margin, w),
    "cos(θ + m(a)) where cos θ > 0, else cos θ (the authors' easy margin; `easy_margin` "
    "false: cos θ − m(a)·sin m(a) past π − m(a)); m(a) = l_m + (u_m − l_m)"
    "(a − l_a)/(u_a − l_a), a = ‖f‖ clamped to [l_a, u_a]; loss + λ_g · mean g(a), "
    "g(a) = a/u_a² + 1/a over the global batch", "arXiv:2103.06627 Eq. 3-5")
