"""Cosine-margin target transforms (NormFace, SphereFace, CosFace, ArcFace, combined).

A margin maps the cosine of a sample's **target** class to the value ``psi`` that replaces
it in the logits; non-target logits stay ``s * cos`` (unless the margin declares a non-target
transform: ``partial_fc.nontarget``). The head computes ``logit_target = s * psi(cos_target)``
through the protocol of ``partial_fc.margin_step`` (:meth:`Margin.begin`); the margins that
read batch statistics are in ``partial_fc.adaptive_margins``; ``partial_fc.margin_factory``
builds them all from a config (``build_margin``) and ``partial_fc.margin_rules`` holds the
config's keys and rules. Every ``psi`` is computed in fp32 with its true
derivative by autograd; the deviations are the clamp of ``acos``'s input, stated where it
applies, and the opt-in straight-through gradient (``gradient="straight_through"``, see
:class:`Margin`). A margin owns its scale module (``self.scale``,
fixed or AdaCos, see ``partial_fc.scale``) so that ``head.state_dict()`` holds the scale
state.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor, nn

from partial_fc.margin_rules import (
    MarginGradient,
    combined_errors,
    raise_errors,
    sphereface_errors,
    warmup_errors,
)
from partial_fc.margin_step import MarginBatch, MarginStep
from partial_fc.nontarget import NonTarget
from partial_fc.scale import AdaCosScale, FixedScale

__all__ = ["CombinedMargin", "Margin", "SphereFaceMargin"]

# acos is clamped to [-1 + eps, 1 - eps]: 1 - 1e-7 rounds to the fp32 value 1 - 2**-23, where
# |d acos / d cos| is about 2.9e3 instead of infinity.
_ACOS_EPS = 1e-7


class Margin(nn.Module):
    """Base class: a target transform ``psi`` plus the scale module ``scale``.

    Margin warm-up (``warmup_steps > 0``): the head uses :meth:`begin`, which scales the
    margin's penalty ``cos - psi(cos)`` by ``t = min(1, step / warmup_steps)``, i.e.
    ``target = (1 - t) cos + t psi(cos)``: no margin (NormFace) at the first step, the full
    margin from step ``warmup_steps`` on. For CosFace this is the margin ``t m`` exactly; for
    the others it is the blend SphereFace's own annealing uses (arXiv:1704.08063), monotone in
    the angle as both ends are. It eases the start of training where a full angular margin
    stalls or diverges (ArcFace on ViTs: insightface issues #2144, #2043). The position in the
    ramp is the head's ``step`` buffer, so checkpoints (the head's state_dict) carry it.

    Gradient (``gradient``): ``"exact"`` differentiates ``target`` as written.
    ``"straight_through"`` keeps the forward value and takes ``d target / d cos = 1``: the
    margin term ``target(cos) - cos`` is a constant in the backward. That is what insightface's
    arcface_torch computes (``CombinedMarginLoss`` applies the angular margin in place under
    ``torch.no_grad``), so its published ArcFace numbers were trained with it; for CosFace
    and NormFace the two coincide (``docs/insightface.md`` has the measured difference).
    """

    gradient: MarginGradient = "exact"  # build_margin sets it from the config

    def __init__(self, scale: FixedScale | AdaCosScale, warmup_steps: int = 0) -> None:
        super().__init__()
        raise_errors(warmup_errors(warmup_steps))
        self.scale = scale
        self.warmup_steps = int(warmup_steps)

    def psi(self, cos: Tensor, step: int) -> Tensor:
        """Target value for target cosines ``cos`` (any shape), fp32; ``step`` = the head's
        training steps so far (only SphereFace's lambda schedule reads it)."""
        raise NotImplementedError

    def warmup_factor(self, step: int) -> float:
        """The share ``t`` of the margin applied after ``step`` training steps."""
        return 1.0 if step >= self.warmup_steps else step / self.warmup_steps

    # The head's side of the protocol (partial_fc.margin_step). A margin that needs more than
    # psi(cos, step) overrides ``needs_norms`` and ``prepare``.
    needs_norms = False  # whether prepare reads MarginBatch.norms
    interclass_filter: float | None = None  # arcface_torch's tau (partial_fc.nontarget)

    def prepare(self, batch: MarginBatch) -> MarginStep:
        """This forward's target transform (before the warm-up), non-target transform, loss
        term and statistics; moves the margin's EMAs when ``batch.training``."""
        return MarginStep(psi=lambda c, _aux: self.psi(c, batch.step))

    def begin(self, batch: MarginBatch) -> MarginStep:
        """:meth:`prepare` under the warm-up (the target's penalty scaled by
        ``warmup_factor``), with the straight-through gradient when ``gradient`` asks for it
        (the margin term a constant in the backward: no gradient to ``aux`` either) and with
        the inter-class filter, if any."""
        out = self.prepare(batch)
        t, straight = self.warmup_factor(batch.step), self.gradient == "straight_through"

        def psi(c: Tensor, aux: Tensor | None, inner=out.psi) -> Tensor:
            value = inner(c, aux)
            if t != 1.0:
                value = torch.lerp(c.float(), value, t)
            return c.float() + (value - c.float()).detach() if straight else value
        nontarget = out.nontarget
        if self.interclass_filter is not None:
            nontarget = NonTarget(tau=self.interclass_filter) if nontarget is None else \
                dataclasses.replace(nontarget, tau=self.interclass_filter)
        return dataclasses.replace(out, psi=psi, nontarget=nontarget)

    def torch_path_reason(self) -> str | None:
        """Why this margin needs the class tiles' torch path (a non-target transform, which
        the Triton kernels do not apply), or None."""
        if self.interclass_filter is not None:
            return "margin.interclass_filter zeroes non-target cosines above it"
        return None


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

    def __init__(self, scale: FixedScale | AdaCosScale, m1: float = 1.0, m2: float = 0.0,
                 m3: float = 0.0, easy_margin: bool = False, warmup_steps: int = 0) -> None:
        super().__init__(scale, warmup_steps)
        raise_errors(combined_errors(m1, m2, m3, easy_margin))
        self.m1, self.m2, self.m3, self.easy_margin = float(m1), float(m2), float(m3), easy_margin
        # theta_th: where m1*theta + m2 reaches pi; None when it never does on [0, pi].
        self.theta_th = (math.pi - m2) / m1 if m1 * math.pi + m2 > math.pi else None

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
        return (f"m1={self.m1}, m2={self.m2}, m3={self.m3}, easy_margin={self.easy_margin}, "
                f"warmup_steps={self.warmup_steps}")


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
    and ``step`` counts the head's training steps. ``lambda_base = 0`` disables it.
    """

    def __init__(
        self,
        scale: FixedScale | AdaCosScale,
        m: int = 4,
        lambda_base: float = 1000.0,
        lambda_gamma: float = 0.12,
        lambda_power: float = 1.0,
        lambda_min: float = 5.0,
        warmup_steps: int = 0,
    ) -> None:
        super().__init__(scale, warmup_steps)
        lambdas = {"lambda_base": lambda_base, "lambda_gamma": lambda_gamma,
                   "lambda_power": lambda_power, "lambda_min": lambda_min}
        raise_errors(sphereface_errors(m, lambdas))
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
        return (f"m={self.m}, lambda_base={self.lambda_base}, lambda_min={self.lambda_min}, "
                f"warmup_steps={self.warmup_steps}")
