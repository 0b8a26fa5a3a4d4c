"""What a margin needs from a step and gives to it: the one small Protocol between a margin and
the head.

Before the softmax the head hands every margin a :class:`MarginBatch`: the global batch's
target cosines and, when the margin asks for them (``needs_norms``), the feature norms of the
un-normalised embeddings, both replicated on every rank (the target cosines from the
statistics all-reduce of ``partial_fc.batch_stats``, the norms gathered with the embeddings).
So every statistic a margin computes from them (AdaFace's norm moments, CurricularFace's
``t``, ElasticFace+'s ranking, MagFace's regulariser) is one of the *global* batch, equal on
every rank. The margin answers with a :class:`MarginStep`: its target transform ``psi``
(applied to the ``N`` target cosines outside the class tiles, so the Triton kernels run it),
an optional non-target transform (``partial_fc.nontarget``, which every tile back-end
applies column by column), an optional loss term and its statistics. EMA state lives in the
margin's buffers, so the head's ``state_dict`` carries it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import Tensor

from partial_fc.nontarget import NonTarget

__all__ = ["MarginBatch", "MarginStep"]


@dataclass(frozen=True)
class MarginBatch:
    """The step as a margin sees it, identical on every rank.

    ``target_cos`` ``[N]`` fp32, detached: each sample's target cosine (over all shards);
    ``norms`` ``[N]`` fp32 ``||x_i||`` of the embeddings before normalisation, gathered
    (differentiable: MagFace's margin depends on them), or None when the margin does not ask;
    ``rows``: this rank's rows of the global batch (for a loss term each rank adds its share
    of); ``step``: the head's training steps before this one; ``draw``: the forwards of this
    step before this one (gradient accumulation); ``training``: whether EMAs move.
    """

    target_cos: Tensor
    norms: Tensor | None
    rows: slice
    step: int
    draw: int
    training: bool


@dataclass(frozen=True)
class MarginStep:
    """A margin's answer for one forward.

    ``psi(c, aux)``: the target value of target cosines ``c`` ``[N]`` (differentiable in both;
    ``aux`` is :attr:`aux`); ``aux``: a differentiable per-sample input of ``psi`` whose
    gradient the softmax returns (MagFace: the norms), or None; ``nontarget``: the non-target
    transform, or None; ``penalty``: this rank's share of an extra loss term (0-d,
    differentiable; the head all-reduces the shares), or None; ``stats``: 0-d device tensors,
    identical on every rank, for ``PartialFC.stats``.
    """

    psi: Callable[[Tensor, Tensor | None], Tensor]
    aux: Tensor | None = None
    nontarget: NonTarget | None = None
    penalty: Tensor | None = None
    stats: Mapping[str, Tensor] = field(default_factory=dict)

