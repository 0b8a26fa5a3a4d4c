"""Margins that adapt per sample or per step: AdaFace, CurricularFace, MagFace, ElasticFace.

Each reads the global batch through ``partial_fc.margin_step`` (a :class:`MarginBatch` in, a
:class:`MarginStep` out), so its statistic is the whole batch's on every rank and its EMA is
a buffer of the head's ``state_dict``. ``statistic(batch)`` is the one place each margin
reads a batch statistic (a test shows that feeding it one rank's rows breaks exactness).
Every transform is differentiated by autograd in fp32; ``acos``'s input is clamped as in
``partial_fc.margins`` (or as the paper's code clamps it, where stated).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from partial_fc import metric_names as names
from partial_fc.init import derive_seed
from partial_fc.margin_step import MarginBatch, MarginStep
from partial_fc.margins import _ACOS_EPS, CombinedMargin, Margin
from partial_fc.nontarget import NonTarget
from partial_fc.scale import AdaCosScale, FixedScale

__all__ = ["AdaFaceMargin", "CurricularFaceMargin", "ElasticMargin", "MagFaceMargin",
           "build_adaptive", "elastic_generator"]

_ADAFACE_EPS = 1e-3  # the paper code's eps: cosine clamp, theta clip, std guard
_ELASTIC_KEY = 0xE1A5  # the first key of ElasticFace's margin draws (see elastic_generator)


def _acos(c: Tensor) -> Tensor:
    return torch.acos(c.float().clamp(-1.0 + _ACOS_EPS, 1.0 - _ACOS_EPS))


def _spread(x: Tensor) -> dict[str, Tensor]:
    """Mean and unbiased std of a 1-D tensor (std 0 for one element)."""
    std = x.std() if x.numel() > 1 else torch.zeros((), device=x.device)
    return {"mean": x.mean(), "std": std}


class AdaFaceMargin(Margin):
    """AdaFace (Kim et al., arXiv:2204.00964 Eq. 11-13): with the feature norm ``||z_i||``
    (clipped to [0.001, 100], detached) and the EMAs ``mu_z``, ``sigma_z`` of the batch's norm
    mean and std, ``z_hat = clip(h (||z|| - mu_z) / (sigma_z + eps), -1, 1)`` and

        psi(cos) = cos(clip(theta + g_angle, eps, pi - eps)) - g_add,
        g_angle = -m z_hat,  g_add = m z_hat + m.

    The EMAs (``alpha = ema``, Eq. 12; initial values 20 and 100 as the paper's code) move
    with the *global* batch before the step uses them, as the code does per GPU. Like that
    code, the target cosine is clamped to ``[-1 + 1e-3, 1 - 1e-3]`` (zero gradient past it);
    unlike it, non-target cosines are not clamped (they differ only above 0.999).
    """

    needs_norms = True

    def __init__(self, scale: FixedScale | AdaCosScale, m: float = 0.4, h: float = 0.333,
                 ema: float = 0.01, warmup_steps: int = 0) -> None:
        super().__init__(scale, warmup_steps)
        self.m, self.h, self.ema = float(m), float(h), float(ema)
        self.register_buffer("batch_mean", torch.full((), 20.0))
        self.register_buffer("batch_std", torch.full((), 100.0))

    def statistic(self, batch: MarginBatch) -> dict[str, Tensor]:
        """The batch's norm mean and std (Eq. 12's ``mu``, ``sigma`` before the EMA)."""
        return _spread(batch.norms.detach().float().clamp(0.001, 100.0))

    def prepare(self, batch: MarginBatch) -> MarginStep:
        norms = batch.norms.detach().float().clamp(0.001, 100.0)
        moments = self.statistic(batch)
        if batch.training:
            with torch.no_grad():
                self.batch_mean.copy_(moments["mean"] * self.ema + (1 - self.ema) * self.batch_mean)
                self.batch_std.copy_(moments["std"] * self.ema + (1 - self.ema) * self.batch_std)
        z_hat = ((norms - self.batch_mean) / (self.batch_std + _ADAFACE_EPS) * self.h).clamp(-1, 1)
        g_angle, g_add = -self.m * z_hat, self.m * z_hat + self.m

        def psi(c: Tensor, _aux: Tensor | None) -> Tensor:
            theta = torch.acos(c.float().clamp(-1 + _ADAFACE_EPS, 1 - _ADAFACE_EPS))
            return torch.cos((theta + g_angle).clamp(_ADAFACE_EPS, math.pi - _ADAFACE_EPS)) - g_add

        stats = {names.NORM_MEAN: moments["mean"], names.NORM_STD: moments["std"],
                 names.ADAFACE_EMA_MEAN: self.batch_mean.clone(),
                 names.ADAFACE_EMA_STD: self.batch_std.clone(),
                 **_shares(z_hat, names.ADAFACE_ZHAT_BINS)}
        return MarginStep(psi=psi, stats=stats)

    def extra_repr(self) -> str:
        return f"m={self.m}, h={self.h}, ema={self.ema}, warmup_steps={self.warmup_steps}"


def _shares(z_hat: Tensor, bins: tuple[str, ...]) -> dict[str, Tensor]:
    """The share of ``z_hat`` (in [-1, 1]) in each of ``len(bins)`` equal bins: AdaFace's
    ``z_hat`` histogram as scalars every sink can plot."""
    k = len(bins)
    idx = ((z_hat.detach() + 1) * (k / 2)).floor().clamp(0, k - 1).long()
    counts = torch.bincount(idx, minlength=k).double() / z_hat.numel()
    return dict(zip(bins, counts.unbind(), strict=True))


class CurricularFaceMargin(CombinedMargin):
    """CurricularFace (Huang et al., arXiv:2004.00288 Eq. 6-9): the target is ArcFace's
    ``cos(theta + m)`` (with insightface's fallback past ``pi - m``), and each non-target
    cosine ``c`` above ``cos(theta_y + m)`` (a hard negative) becomes ``c (t + c)`` on every
    shard (``partial_fc.nontarget``). ``t`` (Eq. 9) is the EMA, ``t <- ema * r + (1 - ema) t``
    from 0, of ``r``, the mean target cosine of the *global* batch, updated before the step
    uses it (as the paper's code); neither ``t`` nor the threshold carries a gradient."""

    def __init__(self, scale: FixedScale | AdaCosScale, m: float = 0.5, ema: float = 0.01,
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

    def torch_path_reason(self) -> str | None:
        return "CurricularFace modulates the hard non-target cosines on every shard"

    def extra_repr(self) -> str:
        return f"m={self.m2}, ema={self.ema}, warmup_steps={self.warmup_steps}"


class MagFaceMargin(Margin):
    """MagFace (Meng et al., arXiv:2103.06627 Eq. 3-5): with ``a_i = ||f_i||`` clamped to
    ``[l_a, u_a]`` (gradient flows inside), the margin ``m(a) = (u_m - l_m) / (u_a - l_a)
    (a - l_a) + l_m`` and ``psi = cos(theta + m(a))`` (past ``theta = pi - m(a)``:
    ``cos - m(a) sin(pi - m(a))``, as the paper's code); the loss adds
    ``lambda_g * mean_i g(a_i)``, ``g(a) = a / u_a^2 + 1 / a`` (Eq. 4), averaged over the
    *global* batch. Both the margin and the regulariser pass their gradient to the norm."""

    needs_norms = True

    def __init__(self, scale: FixedScale | AdaCosScale, l_a: float = 10.0, u_a: float = 110.0,
                 l_m: float = 0.45, u_m: float = 0.8, lambda_g: float = 35.0,
                 warmup_steps: int = 0) -> None:
        super().__init__(scale, warmup_steps)
        self.l_a, self.u_a, self.l_m, self.u_m = float(l_a), float(u_a), float(l_m), float(u_m)
        self.lambda_g = float(lambda_g)

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
            out = torch.cos(_acos(c) + m)
            fallback = c.float() - torch.sin(math.pi - m) * m
            return torch.where(c.float() > torch.cos(math.pi - m), out, fallback)

        own = norms[batch.rows].clamp(self.l_a, self.u_a)
        penalty = self.lambda_g * (own / self.u_a ** 2 + 1.0 / own).sum() / self.statistic(batch)
        spread = _spread(norms.detach())
        stats = {names.NORM_MEAN: spread["mean"], names.NORM_STD: spread["std"],
                 names.NORM_MIN: norms.detach().min(), names.NORM_MAX: norms.detach().max()}
        return MarginStep(psi=psi, aux=norms, penalty=penalty, stats=stats)

    def extra_repr(self) -> str:
        return (f"l_a={self.l_a}, u_a={self.u_a}, l_m={self.l_m}, u_m={self.u_m}, "
                f"lambda_g={self.lambda_g}")


def elastic_generator(step: int, draw: int) -> torch.Generator:
    """The CPU generator of ElasticFace's margins at ``(step, draw)``: seeded by
    ``derive_seed(0xE1A5, step, draw)``; the margins are ``m + sigma * randn(N)`` drawn from it
    in float64. The same on every rank, so every shard sees the same margin per sample."""
    return torch.Generator().manual_seed(derive_seed(_ELASTIC_KEY, step, draw))


class ElasticMargin(Margin):
    """ElasticFace (Boutros et al., arXiv:2109.09416 Eq. 4-5): a margin drawn per sample and
    step from ``N(m, sigma^2)``: ``psi = cos(theta + m_i)`` (``kind="arc"``, no fallback, as
    the paper's code) or ``cos - m_i`` (``"cos"``). ``sort`` (ElasticFace+, Sec. III-C): the
    step's draws, sorted, go to the samples by their target cosine over the *global* batch,
    the largest cosine getting the smallest margin. (The paper's code indexes the sorted
    margins by the argsort, a permutation that matches this only for some orders; this
    follows the paper's text.) The draws come from :func:`elastic_generator`."""

    def __init__(self, scale: FixedScale | AdaCosScale, kind: Literal["arc", "cos"],
                 m: float, sigma: float, sort: bool = False, warmup_steps: int = 0) -> None:
        super().__init__(scale, warmup_steps)
        self.kind, self.m, self.sigma, self.sort = kind, float(m), float(sigma), bool(sort)

    def statistic(self, batch: MarginBatch) -> Tensor:
        """ElasticFace+'s ranking: each sample's place ``[N]`` among the target cosines in
        descending order (stable), 0 for the largest."""
        order = torch.sort(batch.target_cos, descending=True, stable=True).indices
        return torch.empty_like(order).scatter_(0, order, torch.arange(len(order),
                                                                       device=order.device))

    def prepare(self, batch: MarginBatch) -> MarginStep:
        n = batch.target_cos.numel()
        draws = torch.randn(n, generator=elastic_generator(batch.step, batch.draw),
                            dtype=torch.float64) * self.sigma + self.m
        margins = draws.float().to(batch.target_cos.device)
        if self.sort:
            margins = torch.sort(margins).values[self.statistic(batch)]
        if self.kind == "arc":
            def psi(c: Tensor, _aux: Tensor | None) -> Tensor:
                return torch.cos(_acos(c) + margins)
        else:
            def psi(c: Tensor, _aux: Tensor | None) -> Tensor:
                return c.float() - margins
        return MarginStep(psi=psi, stats={names.ELASTIC_MARGIN_MEAN: margins.mean()})

    def extra_repr(self) -> str:
        return f"kind={self.kind}, m={self.m}, sigma={self.sigma}, sort={self.sort}"


def build_adaptive(kind: str, scale: FixedScale | AdaCosScale, m: float, warmup: int,
              keys: Mapping[str, Any], elastic_sort: bool) -> Margin:
    """The margin of ``kind`` (one of this module's types) for ``build_margin``."""
    if kind == "adaface":
        return AdaFaceMargin(scale, m, keys["h"], keys["ema"], warmup)
    if kind == "curricularface":
        return CurricularFaceMargin(scale, m, keys["ema"], warmup)
    if kind == "magface":
        return MagFaceMargin(scale, keys["l_a"], keys["u_a"], keys["l_m"], keys["u_m"],
                                keys["lambda_g"], warmup)
    return ElasticMargin(scale, "arc" if kind == "elasticface_arc" else "cos", m,
                            keys["sigma"], elastic_sort, warmup)
