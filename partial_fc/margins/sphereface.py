"""SphereFace's A-Softmax (arXiv:1704.08063) with its annealing."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from partial_fc.margins.base import Margin, Scale
from partial_fc.margins.keys import MarginSpec, key, key_errors, raise_errors

__all__ = ["SPHEREFACE", "SphereFaceMargin", "chebyshev_t"]


@dataclass(frozen=True)
class SphereFaceConfig:
    m: float = key(4, "the angle multiplier (cos(m*theta) is a Chebyshev polynomial only for "
                   "an integer)", ge=1, integer=True)
    lambda_base: float = key(1000.0, "annealing: the initial weight of the plain cosine; 0 "
                             "disables the annealing", ge=0)
    lambda_gamma: float = key(0.12, "annealing: lambda = lambda_base*(1 + gamma*step)^-power",
                              ge=0)
    lambda_power: float = key(1.0, "annealing: decay exponent", ge=0)
    lambda_min: float = key(5.0, "annealing: floor of lambda", ge=0)


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
        scale: Scale,
        m: int = 4,
        lambda_base: float = 1000.0,
        lambda_gamma: float = 0.12,
        lambda_power: float = 1.0,
        lambda_min: float = 5.0,
        warmup_steps: int = 0,
    ) -> None:
        super().__init__(scale, warmup_steps)
        config = SphereFaceConfig(m, lambda_base, lambda_gamma, lambda_power, lambda_min)
        raise_errors(key_errors(SphereFaceConfig, vars(config), "sphereface"))
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


SPHEREFACE = MarginSpec(
    "sphereface", SphereFaceConfig,
    lambda c, scale, w: SphereFaceMargin(scale, c.m, c.lambda_base, c.lambda_gamma,
                                         c.lambda_power, c.lambda_min, w),
    "(−1)^k cos(mθ) − 2k, annealed", "arXiv:1704.08063")
