"""AdaFace (Kim et al., arXiv:2204.00964): a margin adapted to each sample's feature norm."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from partial_fc import metric_names as names
from partial_fc.margins.base import Margin, Scale, spread
from partial_fc.margins.keys import MarginSpec, key
from partial_fc.margins.step import MarginBatch, MarginStep
from partial_fc.nontarget import NonTarget

__all__ = ["ADAFACE", "AdaFaceMargin"]

EPS = 1e-3  # the authors' eps (head.py): cosine clamp, theta clip, std guard


@dataclass(frozen=True)
class AdaFaceConfig:
    m: float = key(0.4, "radians added to the target angle at z_hat = -1 (and subtracted "
                   "from the cosine at z_hat = 1)", ge=0, lt=math.pi)
    h: float = key(0.333, "concentration of the norm's z-score", gt=0)
    ema: float = key(0.01, "EMA weight of the global batch's norm mean and std (Eq. 12)",
                     gt=0, le=1)
    clamp_nontarget: bool = key(True, "clamp the non-target cosines to [-1 + 1e-3, 1 - 1e-3] "
                                "as the authors' head.py does; false: the target only")


class AdaFaceMargin(Margin):
    """AdaFace (arXiv:2204.00964 Eq. 11-13): with the feature norm ``||z_i||`` (clipped to
    [0.001, 100], detached) and the EMAs ``mu_z``, ``sigma_z`` of the batch's norm mean and
    std, ``z_hat = clip(h (||z|| - mu_z) / (sigma_z + eps), -1, 1)`` and

        psi(cos) = cos(clip(theta + g_angle, eps, pi - eps)) - g_add,
        g_angle = -m z_hat,  g_add = m z_hat + m.

    The EMAs (``alpha = ema``, Eq. 12; initial values 20 and 100 as the authors' code) move
    with the *global* batch before the step uses them, as the code does per GPU. As that code
    (mk-minchul/AdaFace ``head.py``), every cosine is clamped to ``[-1 + 1e-3, 1 - 1e-3]``
    (zero gradient past it): the target in ``psi``, the non-target ones by a non-target
    transform (``partial_fc.nontarget``, which the Triton kernels apply too).
    ``clamp_nontarget=False`` clamps the target only.
    """

    needs_norms = True

    def __init__(self, scale: Scale, m: float = 0.4, h: float = 0.333, ema: float = 0.01,
                 clamp_nontarget: bool = True, warmup_steps: int = 0) -> None:
        super().__init__(scale, warmup_steps)
        self.m, self.h, self.ema = float(m), float(h), float(ema)
        self.clamp_nontarget = bool(clamp_nontarget)
        self.register_buffer("batch_mean", torch.full((), 20.0))
        self.register_buffer("batch_std", torch.full((), 100.0))

    def statistic(self, batch: MarginBatch) -> dict[str, Tensor]:
        """The batch's norm mean and std (Eq. 12's ``mu``, ``sigma`` before the EMA)."""
        return spread(batch.norms.detach().float().clamp(0.001, 100.0))

    def prepare(self, batch: MarginBatch) -> MarginStep:
        norms = batch.norms.detach().float().clamp(0.001, 100.0)
        moments = self.statistic(batch)
        if batch.training:
            with torch.no_grad():
                self.batch_mean.copy_(moments["mean"] * self.ema + (1 - self.ema) * self.batch_mean)
                self.batch_std.copy_(moments["std"] * self.ema + (1 - self.ema) * self.batch_std)
        z_hat = ((norms - self.batch_mean) / (self.batch_std + EPS) * self.h).clamp(-1, 1)
        g_angle, g_add = -self.m * z_hat, self.m * z_hat + self.m

        def psi(c: Tensor, _aux: Tensor | None) -> Tensor:
            theta = torch.acos(c.float().clamp(-1 + EPS, 1 - EPS))
            return torch.cos((theta + g_angle).clamp(EPS, math.pi - EPS)) - g_add

        stats = {names.NORM_MEAN: moments["mean"], names.NORM_STD: moments["std"],
                 names.ADAFACE_EMA_MEAN: self.batch_mean.clone(),
                 names.ADAFACE_EMA_STD: self.batch_std.clone(),
                 **_shares(z_hat, names.ADAFACE_ZHAT_BINS)}
        nontarget = NonTarget(clamp=EPS) if self.clamp_nontarget else None
        return MarginStep(psi=psi, nontarget=nontarget, stats=stats)

    def extra_repr(self) -> str:
        return (f"m={self.m}, h={self.h}, ema={self.ema}, clamp_nontarget="
                f"{self.clamp_nontarget}, warmup_steps={self.warmup_steps}")


def _shares(z_hat: Tensor, bins: tuple[str, ...]) -> dict[str, Tensor]:
    """The share of ``z_hat`` (in [-1, 1]) in each of ``len(bins)`` equal bins: AdaFace's
    ``z_hat`` histogram as scalars every sink can plot."""
    k = len(bins)
    idx = ((z_hat.detach() + 1) * (k / 2)).floor().clamp(0, k - 1).long()
    counts = torch.bincount(idx, minlength=k).double() / z_hat.numel()
    return dict(zip(bins, counts.unbind(), strict=True))


ADAFACE = MarginSpec(
    "adaface", AdaFaceConfig,
    lambda c, scale, w: AdaFaceMargin(scale, c.m, c.h, c.ema, c.clamp_nontarget, w),
    "cos(θ − m·ẑ) − (m + m·ẑ), ẑ = clip(h(‖z‖ − μ)/(σ + ε), −1, 1); μ, σ: EMAs of the global "
    "batch's norm mean/std (norm detached); every cosine clamped to [−1 + 10⁻³, 1 − 10⁻³] "
    "(`clamp_nontarget` false: the target only)",
    "arXiv:2204.00964 Eq. 11-13")
