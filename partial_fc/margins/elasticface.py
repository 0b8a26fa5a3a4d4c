"""ElasticFace (Boutros et al., arXiv:2109.09416): a margin drawn per sample and step, and
ElasticFace+, which hands the step's draws out by target cosine."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from partial_fc import metric_names as names
from partial_fc.init import derive_seed
from partial_fc.margins.base import Margin, Scale, acos
from partial_fc.margins.keys import MarginSpec, key
from partial_fc.margins.step import MarginBatch, MarginStep

__all__ = ["ELASTIC_SPECS", "ElasticMargin", "elastic_generator"]

_KEY = 0xE1A5  # the first key of ElasticFace's margin draws (see elastic_generator)
ElasticSort = Literal["authors", "paper"]


def elastic_generator(step: int, draw: int) -> torch.Generator:
    """The CPU generator of ElasticFace's margins at ``(step, draw)``: seeded by
    ``derive_seed(0xE1A5, step, draw)``; the margins are ``m + sigma * randn(N)`` drawn from it
    in float64. The same on every rank, so every shard sees the same margin per sample."""
    return torch.Generator().manual_seed(derive_seed(_KEY, step, draw))


class ElasticMargin(Margin):
    """ElasticFace (arXiv:2109.09416 Eq. 4-5): a margin drawn per sample and step from
    ``N(m, sigma^2)``: ``psi = cos(theta + m_i)`` (``kind="arc"``, no fallback, as the authors'
    ``utils/losses.py``) or ``cos - m_i`` (``"cos"``). The draws come from
    :func:`elastic_generator`.

    ElasticFace+ (``sort``, Sec. III-C) sorts the step's draws ascending and hands them out by
    the target cosines of the *global* batch, in one of two ways:

    - ``"authors"`` (fdbtrs/ElasticFace ``utils/losses.py``, which the released + models
      trained with): sample ``i`` gets ``sorted[order[i]]``, ``order`` the descending argsort
      of the target cosines, i.e. it gathers by the sorting permutation;
    - ``"paper"`` (its text): sample ``i`` gets ``sorted[rank_i]``, ``rank_i`` its place in
      descending order, so the largest cosine gets the smallest margin.

    The two agree only where the permutation is its own inverse.
    """

    def __init__(self, scale: Scale, kind: Literal["arc", "cos"], m: float, sigma: float,
                 sort: ElasticSort | None = None, warmup_steps: int = 0) -> None:
        super().__init__(scale, warmup_steps)
        self.kind, self.m, self.sigma, self.sort = kind, float(m), float(sigma), sort

    def statistic(self, batch: MarginBatch) -> Tensor:
        """ElasticFace+'s index ``[N]`` into the sorted draws: the descending order of the
        target cosines (stable; ``"authors"``) or each sample's place in it (``"paper"``)."""
        order = torch.sort(batch.target_cos, descending=True, stable=True).indices
        if self.sort == "authors":
            return order
        return torch.empty_like(order).scatter_(0, order, torch.arange(len(order),
                                                                       device=order.device))

    def prepare(self, batch: MarginBatch) -> MarginStep:
        n = batch.target_cos.numel()
        draws = torch.randn(n, generator=elastic_generator(batch.step, batch.draw),
                            dtype=torch.float64) * self.sigma + self.m
        margins = draws.float().to(batch.target_cos.device)
        if self.sort is not None:
            margins = torch.sort(margins).values[self.statistic(batch)]
        if self.kind == "arc":
            def psi(c: Tensor, _aux: Tensor | None) -> Tensor:
                return torch.cos(acos(c.float()) + margins)
        else:
            def psi(c: Tensor, _aux: Tensor | None) -> Tensor:
                return c.float() - margins
        return MarginStep(psi=psi, stats={names.ELASTIC_MARGIN_MEAN: margins.mean()})

    def extra_repr(self) -> str:
        return f"kind={self.kind}, m={self.m}, sigma={self.sigma}, sort={self.sort}"


_SIGMA = "std of the per-sample margin N(m, sigma^2) (the authors' config.py)"
_SORT = ("authors: sample i gets sorted_margins[argsort_desc(cos)[i]] as the authors' code; "
         "paper: by rank, the largest target cosine the smallest margin")
_ARC_M, _COS_M = "radians added to the target angle", "subtracted from the target cosine"


@dataclass(frozen=True)
class ElasticArcConfig:
    m: float = key(0.5, _ARC_M, ge=0, lt=math.pi)
    sigma: float = key(0.05, _SIGMA, ge=0)


@dataclass(frozen=True)
class ElasticCosConfig:
    m: float = key(0.35, _COS_M, ge=0)
    sigma: float = key(0.05, _SIGMA, ge=0)


@dataclass(frozen=True)
class ElasticArcPlusConfig:
    m: float = key(0.5, _ARC_M, ge=0, lt=math.pi)
    sigma: float = key(0.0175, _SIGMA, ge=0)
    elastic_sort: ElasticSort = key("authors", _SORT)


@dataclass(frozen=True)
class ElasticCosPlusConfig:
    m: float = key(0.35, _COS_M, ge=0)
    sigma: float = key(0.02, _SIGMA, ge=0)
    elastic_sort: ElasticSort = key("authors", _SORT)


def _builder(kind: Literal["arc", "cos"]):
    def build(c, scale: Scale, warmup: int) -> ElasticMargin:
        return ElasticMargin(scale, kind, c.m, c.sigma, getattr(c, "elastic_sort", None), warmup)
    return build


_PLUS = ("; ElasticFace+: the step's sorted draws handed out by target cosine over the global "
         "batch (`margin.elastic_sort`)")
ELASTIC_SPECS = (
    MarginSpec("elasticface_arc", ElasticArcConfig, _builder("arc"),
               "cos(θ + m_i), m_i ~ N(m, σ²) per sample and step, the same draw on every rank",
               "arXiv:2109.09416 Eq. 4"),
    MarginSpec("elasticface_cos", ElasticCosConfig, _builder("cos"), "cos θ − m_i",
               "arXiv:2109.09416 Eq. 5"),
    MarginSpec("elasticface_arc_plus", ElasticArcPlusConfig, _builder("arc"),
               "cos(θ + m_i)" + _PLUS, "arXiv:2109.09416 Sec. III-C"),
    MarginSpec("elasticface_cos_plus", ElasticCosPlusConfig, _builder("cos"),
               "cos θ − m_i" + _PLUS, "arXiv:2109.09416 Sec. III-C"),
)
