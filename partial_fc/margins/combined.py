"""The combined-margin family ``cos(m1*theta + m2) - m3`` (ArcFace, arXiv:1801.07698 Eq. 4)
and its special cases: NormFace, CosFace, ArcFace, AdaCos (a plain cosine under the AdaCos
scale) and ``combined`` itself."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from partial_fc.margins.base import Margin, Scale, acos
from partial_fc.margins.keys import Error, MarginSpec, error, key, key_errors, raise_errors

__all__ = ["ARCFACE", "COMBINED", "COSFACE", "NORMFACE", "ADACOS", "CombinedMargin"]

_EASY = ("apply the margin only where cos(theta) > 0, elsewhere psi = cos(theta) (the easy "
         "margin); false: past pi - m the first-order penalty cos(theta) - m sin(m)")


def _easy_margin_errors(m1: float, m2: float, name: str) -> list[Error]:
    """``easy_margin`` keeps ``cos(m1*theta + m2)`` for ``cos(theta) > 0`` only, so that
    branch must be monotone up to ``theta = pi/2``: ``m1*pi/2 + m2 <= pi``."""
    if m1 * math.pi / 2 + m2 <= math.pi:
        return []
    return [error(name, m2, f"easy_margin needs m1*pi/2 + m2 <= pi (m1={m1})")]


@dataclass(frozen=True)
class NoKeys:
    """NormFace and AdaCos: no key of their own."""


@dataclass(frozen=True)
class CosFaceConfig:
    m: float = key(0.35, "subtracted from the target cosine", ge=0)


@dataclass(frozen=True)
class ArcFaceConfig:
    m: float = key(0.5, "radians added to the target angle", ge=0, lt=math.pi)
    easy_margin: bool = key(False, _EASY)

    def errors(self) -> list[Error]:
        return _easy_margin_errors(1.0, self.m, "m") if self.easy_margin else []


@dataclass(frozen=True)
class CombinedConfig:
    m1: float = key(1.0, "multiplies the target angle (SphereFace-like)", gt=0)
    m2: float = key(0.5, "radians added to the target angle", ge=0, lt=math.pi)
    m3: float = key(0.0, "subtracted from the cosine", ge=0)
    easy_margin: bool = key(False, _EASY)

    def errors(self) -> list[Error]:
        return _easy_margin_errors(self.m1, self.m2, "m2") if self.easy_margin else []


class CombinedMargin(Margin):
    """``psi = cos(m1*theta + m2) - m3`` (ArcFace, arXiv:1801.07698 Eq. 4), all three at once.

    Special cases: NormFace ``(1, 0, 0)``, CosFace ``(1, 0, m)`` (arXiv:1801.09414 Eq. 4),
    ArcFace ``(1, m, 0)`` (arXiv:1801.07698 Eq. 3). When ``m1 == 1 and m2 == 0`` no angle is
    taken (``psi = cos - m3`` exactly, derivative 1 everywhere).

    ``cos(m1*theta + m2)`` stops decreasing once ``m1*theta + m2 > pi``. Past that angle
    ``theta_th = (pi - m2) / m1`` one of two selectable behaviours applies:

    - default: ``psi = cos(theta) - m3 - (pi - theta_th) * sin(theta_th)``, the first-order
      penalty frozen at ``theta_th``; for ArcFace ``cos(theta) - m sin(m)``, the fallback of
      the ArcFace authors' earlier code (insightface's MXNet ``train.py``), of CurricularFace's
      ``head/metrics.py`` and of MagFace's ``easy_margin=False``. arcface_torch's current
      ``CombinedMarginLoss`` has none: it takes ``cos(theta + m)`` at every angle;
    - ``easy_margin=True``: the margin applies only where ``cos(theta) > 0``; elsewhere
      ``psi = cos(theta)`` (the easy margin of insightface's and MagFace's code). Requires
      ``theta_th >= pi/2``.

    Deviation from the exact derivative: ``acos``'s input is clamped (``base.acos``): the true
    derivative of ``cos(theta + m)`` w.r.t. ``cos`` is infinite at ``cos = +-1``. Inside the
    band the gradient is exact; for ``|cos| > 1 - 1e-7`` (``theta`` within 5e-4 rad of 0 or
    pi, below fp32's resolution of cos there) the value is that at the band edge and the
    gradient w.r.t. ``cos`` is 0, never NaN or inf.
    """

    def __init__(self, scale: Scale, m1: float = 1.0, m2: float = 0.0, m3: float = 0.0,
                 easy_margin: bool = False, warmup_steps: int = 0) -> None:
        super().__init__(scale, warmup_steps)
        config = CombinedConfig(m1, m2, m3, easy_margin)
        found = key_errors(CombinedConfig, vars(config), "combined")
        raise_errors(found or config.errors())
        self.m1, self.m2, self.m3, self.easy_margin = float(m1), float(m2), float(m3), easy_margin
        # theta_th: where m1*theta + m2 reaches pi; None when it never does on [0, pi].
        self.theta_th = (math.pi - m2) / m1 if m1 * math.pi + m2 > math.pi else None

    def psi(self, cos: Tensor, step: int) -> Tensor:
        c = cos.float()
        if self.m1 == 1.0 and self.m2 == 0.0:
            return c - self.m3
        out = torch.cos(self.m1 * acos(c) + self.m2) - self.m3
        if self.easy_margin:
            return torch.where(c > 0, out, c)
        if self.theta_th is None:
            return out
        penalty = (math.pi - self.theta_th) * math.sin(self.theta_th)
        return torch.where(c > math.cos(self.theta_th), out, c - self.m3 - penalty)

    def extra_repr(self) -> str:
        return (f"m1={self.m1}, m2={self.m2}, m3={self.m3}, easy_margin={self.easy_margin}, "
                f"warmup_steps={self.warmup_steps}")


NORMFACE = MarginSpec("normface", NoKeys, lambda c, scale, w: CombinedMargin(scale, warmup_steps=w),
                      "cos θ", "arXiv:1704.06369")
ADACOS = MarginSpec("adacos", NoKeys, lambda c, scale, w: CombinedMargin(scale, warmup_steps=w),
                    "cos θ, s from B_avg and θ_med of the global batch (`margin.adacos`)",
                    "arXiv:1905.00292")
COSFACE = MarginSpec("cosface", CosFaceConfig,
                     lambda c, scale, w: CombinedMargin(scale, m3=c.m, warmup_steps=w),
                     "cos θ − m", "arXiv:1801.09414 Eq. 4")
ARCFACE = MarginSpec("arcface", ArcFaceConfig,
                     lambda c, scale, w: CombinedMargin(scale, m2=c.m, easy_margin=c.easy_margin,
                                                        warmup_steps=w),
                     "cos(θ + m) (past π − m: cos θ − m·sin m, the fallback of the ArcFace "
                     "authors' MXNet code; `easy_margin` true: none where cos θ ≤ 0)",
                     "arXiv:1801.07698 Eq. 3")
COMBINED = MarginSpec("combined", CombinedConfig,
                      lambda c, scale, w: CombinedMargin(scale, c.m1, c.m2, c.m3, c.easy_margin, w),
                      "cos(m1·θ + m2) − m3", "arXiv:1801.07698 Eq. 4")
