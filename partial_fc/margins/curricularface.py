"""CurricularFace (Huang et al., arXiv:2004.00288): ArcFace's target, hard negatives weighted
by a curriculum term."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from partial_fc import metric_names as names
from partial_fc.margins.base import Scale
from partial_fc.margins.combined import CombinedMargin
from partial_fc.margins.keys import MarginSpec, key
from partial_fc.margins.step import MarginBatch, MarginStep
from partial_fc.nontarget import NonTarget

__all__ = ["CURRICULARFACE", "CurricularFaceMargin"]


@dataclass(frozen=True)
class CurricularFaceConfig:
    m: float = key(0.5, "radians added to the target angle", ge=0, lt=math.pi)
    ema: float = key(0.01, "EMA weight of the global batch's mean target cosine (Eq. 9)",
                     gt=0, le=1)


class CurricularFaceMargin(CombinedMargin):
    """CurricularFace (Huang et al., arXiv:2004.00288 Eq. 6-9): the target is ArcFace's
    ``cos(theta + m)`` (with the ``cos(theta) - m sin(m)`` fallback past ``pi - m``, as the
    authors' ``head/metrics.py``), and each non-target cosine ``c`` above ``cos(theta_y + m)``
    (a hard negative) becomes ``c (t + c)`` on every shard (``partial_fc.nontarget``). ``t``
    (Eq. 9) is the EMA, ``t <- ema * r + (1 - ema) t`` from 0, of ``r``, the mean target
    cosine of the *global* batch, updated before the step uses it (as the authors' code);
    neither ``t`` nor the threshold carries a gradient."""

    def __init__(self, scale: Scale, m: float = 0.5, ema: float = 0.01,
                 warmup_steps: int = 0) -> None:
        super().__init__(scale, m2=m, warmup_steps=warmup_steps)
        self.ema = float(ema)
        self.register_buffer("t", torch.zeros(()))

    def statistic(self, batch: MarginBatch) -> Tensor:
        """Eq. 9's ``r``: the mean target cosine."""
        return batch.target_cos.float().mean()

    def prepare(self, batch: MarginBatch) -> MarginStep:
        r = self.statistic(batch)
        if batch.training:
            with torch.no_grad():
                self.t.copy_(r * self.ema + (1 - self.ema) * self.t)
        c = batch.target_cos.float().clamp(-1.0, 1.0)
        hard_above = c * math.cos(self.m2) - torch.sqrt(1.0 - c * c) * math.sin(self.m2)
        nontarget = NonTarget(hard_above=hard_above, t=self.t.clone(),
                              hard_rows=torch.zeros_like(c))
        return MarginStep(psi=lambda cos, _aux: self.psi(cos, batch.step), nontarget=nontarget,
                          stats={names.CURRICULAR_T: self.t.clone()})

    def extra_repr(self) -> str:
        return f"m={self.m2}, ema={self.ema}, warmup_steps={self.warmup_steps}"


CURRICULARFACE = MarginSpec(
    "curricularface", CurricularFaceConfig,
    lambda c, scale, w: CurricularFaceMargin(scale, c.m, c.ema, w),
    "as ArcFace; each non-target cos θ_j > cos(θ_y + m) becomes cos θ_j (t + cos θ_j) on every "
    "shard; t: EMA of the global batch's mean target cosine", "arXiv:2004.00288 Eq. 6-9")
