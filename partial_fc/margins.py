"""Cosine-margin target transforms (NormFace, SphereFace, CosFace, ArcFace, combined).

A margin maps the cosine of a sample's **target** class to the value ``psi`` that replaces
it in the logits; non-target logits stay ``s * cos``. The head computes
``logit_target = s * psi(cos_target)``. Every ``psi`` is computed in fp32 with its true
derivative by autograd (no straight-through trick); the only deviation is the clamp of
``acos``'s input, stated where it applies. A margin owns its scale module (``self.scale``,
fixed or AdaCos, see ``partial_fc.scale``) so that ``head.state_dict()`` holds the scale
state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from partial_fc.scale import AdaCosScale, FixedScale

__all__ = ["CombinedMargin", "Margin", "SphereFaceMargin", "build_margin", "MARGIN_TYPES"]

MARGIN_TYPES = ("normface", "sphereface", "cosface", "arcface", "combined", "adacos")
_KEYS = frozenset(
    {"type", "s", "m", "m1", "m2", "m3", "adacos", "easy_margin"}
    | {"lambda_base", "lambda_gamma", "lambda_power", "lambda_min"}
)
# acos is clamped to [-1 + eps, 1 - eps]: 1 - 1e-7 rounds to the fp32 value 1 - 2**-23, where
# |d acos / d cos| is about 2.9e3 instead of infinity.
_ACOS_EPS = 1e-7


class Margin(nn.Module):
    """Base class: a target transform ``psi`` plus the scale module ``scale``."""

    def __init__(self, scale: FixedScale | AdaCosScale) -> None:
        super().__init__()
        self.scale = scale

    def psi(self, cos: Tensor, step: int) -> Tensor:
        """Target value for target cosines ``cos`` (any shape), fp32; ``step`` = training
        forwards so far (only SphereFace's lambda schedule reads it)."""
        raise NotImplementedError


class CombinedMargin(Margin):
    """``psi = cos(m1*theta + m2) - m3`` (ArcFace, arXiv:1801.07698 Eq. 4), all three at once.

    Special cases: NormFace ``(1, 0, 0)``, CosFace ``(1, 0, m)`` (arXiv:1801.09414 Eq. 4),
    ArcFace ``(1, m, 0)`` (arXiv:1801.07698 Eq. 3). When ``m1 == 1 and m2 == 0`` no angle is
    taken (``psi = cos - m3`` exactly, derivative 1 everywhere).

    ``cos(m1*theta + m2)`` stops decreasing once ``m1*theta + m2 > pi``. Past that angle
    ``theta_th = (pi - m2) / m1`` one of two selectable behaviours applies:

    - default: ``psi = cos(theta) - m3 - (pi - theta_th) * sin(theta_th)``, the first-order
      penalty frozen at ``theta_th``; for ArcFace this is insightface's ``cos(theta) - m sin(m)``;
    - ``easy_margin=True``: the margin applies only where ``cos(theta) > 0``; elsewhere
      ``psi = cos(theta)`` (insightface's easy margin). Requires ``theta_th >= pi/2``.

    Deviation from the exact derivative: ``acos``'s input is clamped to ``[-1+1e-7, 1-1e-7]``
    (the true derivative of ``cos(theta + m)`` w.r.t. ``cos`` is infinite at ``cos = +-1``).
    Inside the band the gradient is exact; for ``|cos| > 1 - 1e-7`` (``theta`` within 5e-4
    rad of 0 or pi, below fp32's resolution of cos there) the value is that at the band edge
    and the gradient w.r.t. ``cos`` is 0, never NaN or inf.
    """

    def __init__(
        self,
        scale: FixedScale | AdaCosScale,
        m1: float = 1.0,
        m2: float = 0.0,
        m3: float = 0.0,
        easy_margin: bool = False,
    ) -> None:
        super().__init__(scale)
        if not (math.isfinite(m1) and m1 > 0):
            raise ValueError(f"margin: m1={m1} must be > 0")
        if not 0.0 <= m2 < math.pi:
            raise ValueError(f"margin: m2={m2} must be in [0, pi)")
        if not (math.isfinite(m3) and m3 >= 0):
            raise ValueError(f"margin: m3={m3} must be >= 0")
        self.m1, self.m2, self.m3, self.easy_margin = float(m1), float(m2), float(m3), easy_margin
        # theta_th: where m1*theta + m2 reaches pi; None when it never does on [0, pi].
        self.theta_th = (math.pi - m2) / m1 if m1 * math.pi + m2 > math.pi else None
        if easy_margin and self.theta_th is not None and self.theta_th < math.pi / 2:
            raise ValueError(
                f"margin: easy_margin needs m1*pi/2 + m2 <= pi, got m1={m1}, m2={m2}"
            )

    def psi(self, cos: Tensor, step: int) -> Tensor:
        c = cos.float()
        if self.m1 == 1.0 and self.m2 == 0.0:
            return c - self.m3
        theta = torch.acos(c.clamp(-1.0 + _ACOS_EPS, 1.0 - _ACOS_EPS))
        out = torch.cos(self.m1 * theta + self.m2) - self.m3
        if self.easy_margin:
            return torch.where(c > 0, out, c)
        if self.theta_th is None:
            return out
        penalty = (math.pi - self.theta_th) * math.sin(self.theta_th)
        return torch.where(c > math.cos(self.theta_th), out, c - self.m3 - penalty)

    def extra_repr(self) -> str:
        return f"m1={self.m1}, m2={self.m2}, m3={self.m3}, easy_margin={self.easy_margin}"


def chebyshev_t(c: Tensor, m: int) -> Tensor:
    """``T_m(c) = cos(m * acos(c))`` by the recurrence ``T_{n+1} = 2c T_n - T_{n-1}``: a
    polynomial, so its autograd derivative is exact on all of [-1, 1] (no ``acos``)."""
    prev, cur = torch.ones_like(c), c
    if m == 0:
        return prev
    for _ in range(m - 1):
        prev, cur = cur, 2 * c * cur - prev
    return cur


class SphereFaceMargin(Margin):
    """SphereFace A-Softmax ``psi(theta) = (-1)^k cos(m theta) - 2k`` for
    ``theta in [k pi/m, (k+1) pi/m]`` (arXiv:1704.08063, the A-Softmax loss), monotone on
    [0, pi].

    ``cos(m theta)`` is the Chebyshev polynomial ``T_m(cos theta)`` (integer ``m``, as in the
    paper), so value and derivative are exact including ``cos = +-1``; ``k`` is piecewise
    constant (no gradient). Deviation: the paper multiplies by ``||x||``; here features are
    normalised and the head multiplies by ``s`` (as in the ArcFace combined-margin family).

    Annealing (the paper's optimisation trick, as in its released Caffe layer): with
    ``lambda_base > 0`` the target value is ``(lambda * cos + psi) / (1 + lambda)`` where
    ``lambda = max(lambda_min, lambda_base * (1 + lambda_gamma * step) ** -lambda_power)``
    and ``step`` counts training forwards. ``lambda_base = 0`` disables it.
    """

    def __init__(
        self,
        scale: FixedScale | AdaCosScale,
        m: int = 4,
        lambda_base: float = 1000.0,
        lambda_gamma: float = 0.12,
        lambda_power: float = 1.0,
        lambda_min: float = 5.0,
    ) -> None:
        super().__init__(scale)
        if not (float(m).is_integer() and m >= 1):
            raise ValueError(f"margin: m={m}: SphereFace needs an integer m >= 1 (e.g. 4)")
        for key, val in (("lambda_base", lambda_base), ("lambda_gamma", lambda_gamma),
                         ("lambda_power", lambda_power), ("lambda_min", lambda_min)):
            if not (math.isfinite(val) and val >= 0):
                raise ValueError(f"margin: {key}={val} must be >= 0")
        self.m = int(m)
        self.lambda_base, self.lambda_gamma = float(lambda_base), float(lambda_gamma)
        self.lambda_power, self.lambda_min = float(lambda_power), float(lambda_min)

    def lambda_at(self, step: int) -> float:
        """The annealing weight after ``step`` training forwards (0 when disabled)."""
        if self.lambda_base == 0:
            return 0.0
        decayed = self.lambda_base * (1.0 + self.lambda_gamma * step) ** (-self.lambda_power)
        return max(self.lambda_min, decayed)

    def psi(self, cos: Tensor, step: int) -> Tensor:
        c = cos.float().clamp(-1.0, 1.0)
        with torch.no_grad():
            k = torch.floor(self.m * torch.acos(c) / math.pi).clamp(0, self.m - 1)
        out = (1 - 2 * torch.remainder(k, 2)) * chebyshev_t(c, self.m) - 2 * k
        lam = self.lambda_at(step)
        return (lam * c + out) / (1 + lam) if lam > 0 else out

    def extra_repr(self) -> str:
        return f"m={self.m}, lambda_base={self.lambda_base}, lambda_min={self.lambda_min}"


# Per-type defaults of ``m`` (the insightface / paper values); ``s`` defaults to 64.
_DEFAULT_M = {"sphereface": 4, "cosface": 0.35, "arcface": 0.5}


def build_margin(cfg: Mapping[str, Any]) -> Margin:
    """Build a margin from a config dict.

    Keys: ``type`` (one of ``MARGIN_TYPES``), ``s``, ``m`` (SphereFace/CosFace/ArcFace),
    ``m1, m2, m3`` (combined), ``adacos`` (``None | "fixed" | "dynamic"``; required for
    ``type=adacos``, combinable with any other type), ``easy_margin`` (ArcFace/combined),
    ``lambda_base, lambda_gamma, lambda_power, lambda_min`` (SphereFace annealing). A key
    whose value is ``None`` counts as absent; keys a type does not use are ignored, so one
    schema can pass them all. When ``adacos`` is set, ``s`` is ignored (AdaCos sets it).
    Unknown keys or values raise ``ValueError`` naming them.
    """
    unknown = sorted(set(cfg) - _KEYS)
    if unknown:
        raise ValueError(f"margin: unknown key(s) {unknown}; valid keys: {sorted(_KEYS)}")
    get = {k: v for k, v in cfg.items() if v is not None}.get
    kind = get("type")
    if kind not in MARGIN_TYPES:
        raise ValueError(f"margin: type={kind!r} is not one of {'|'.join(MARGIN_TYPES)}")
    adacos = get("adacos")
    if adacos not in (None, "fixed", "dynamic"):
        raise ValueError(f"margin: adacos={adacos!r} is not one of fixed|dynamic")
    if kind == "adacos" and adacos is None:
        raise ValueError("margin: type=adacos needs adacos=fixed|dynamic")
    scale = AdaCosScale(adacos == "dynamic") if adacos else FixedScale(float(get("s", 64.0)))
    m = get("m", _DEFAULT_M.get(kind, 0.0))
    if kind == "sphereface":
        anneal = {k: float(get(k)) for k in _KEYS if k.startswith("lambda_") and get(k) is not None}
        return SphereFaceMargin(scale, m=m, **anneal)
    if kind in ("normface", "adacos"):
        return CombinedMargin(scale)
    if kind == "cosface":
        if not (math.isfinite(m) and m >= 0):
            raise ValueError(f"margin: m={m} must be >= 0 for cosface")
        return CombinedMargin(scale, m3=float(m))
    easy = bool(get("easy_margin", False))
    if kind == "arcface":
        if not 0.0 <= m < math.pi:
            raise ValueError(f"margin: m={m} must be in [0, pi) for arcface")
        return CombinedMargin(scale, m2=float(m), easy_margin=easy)
    return CombinedMargin(
        scale, float(get("m1", 1.0)), float(get("m2", 0.0)), float(get("m3", 0.0)), easy
    )
