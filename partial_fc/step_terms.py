"""One forward's loss terms besides the plain softmax: the margin's answer to the global batch
(``partial_fc.margins.step``) and ArcFace's auxiliary losses (``partial_fc.aux_losses``).

``PartialFC.forward`` calls :func:`step_terms` after the statistics all-reduce
(``partial_fc.batch_stats``), when every rank holds the global batch's target cosines, and
hands the result to ``partial_fc.softmax.margin_softmax_loss``; :func:`finish` adds the terms
that live outside the softmax (MagFace's regulariser, the Triplet-Loss) to its loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from partial_fc import distributed as dist_ops
from partial_fc import metric_names as names
from partial_fc.aux_losses import AuxLosses, inter_loss, intra_loss, triplet_loss
from partial_fc.batch_stats import GlobalStats
from partial_fc.margins import Margin
from partial_fc.margins.step import MarginBatch
from partial_fc.nontarget import NonTarget
from partial_fc.softmax import RowTerm, Shard, TargetTerms

__all__ = ["StepTerms", "finish", "step_terms"]


@dataclass(frozen=True)
class StepTerms:
    """``target``/``row_term`` for the softmax, ``nontarget`` for the shard's tiles,
    ``shares`` (this rank's share of each term outside the softmax, 0-d, differentiable, by
    its statistic's name) and ``stats`` (replicated 0-d tensors; :func:`finish` adds the
    shares' totals and the hard-negative share)."""

    target: TargetTerms
    row_term: RowTerm | None
    nontarget: NonTarget | None
    shares: dict[str, Tensor]
    stats: dict[str, Tensor]


def step_terms(margin: Margin, aux: AuxLosses, batch: MarginBatch, glob: GlobalStats,
               shard: Shard, e: Tensor, labels: Tensor, chunk: int,
               group: dist_ops.ProcessGroup) -> StepTerms:
    """The margin's step and the auxiliary terms (collective when ``aux.inter`` is on).
    ``e`` ``[N, D]`` / ``labels`` ``[N]``: the gathered batch; ``chunk``: class columns per
    block of the Inter-Loss."""
    step = margin.begin(batch)
    stats = dict(step.stats)
    extra = None
    if aux.intra:
        extra = intra_loss(aux.intra)
        stats[names.LOSS_INTRA] = extra(glob.target_cos).double().mean()
    row_term = None
    if aux.inter:
        row_term = inter_loss(shard, glob.negatives, aux.inter, chunk, group)
        stats[names.LOSS_INTER] = row_term.value
    shares = {}
    if step.penalty is not None:
        shares[names.LOSS_MAGFACE_G] = step.penalty
    if aux.triplet:
        shares[names.LOSS_TRIPLET] = aux.triplet * triplet_loss(
            e, labels, batch.rows, aux.triplet_margin)
    return StepTerms(TargetTerms(step.psi, step.aux, extra), row_term, step.nontarget, shares,
                     stats)


def finish(loss: Tensor, terms: StepTerms, glob: GlobalStats,
           group: dist_ops.ProcessGroup) -> Tensor:
    """The softmax ``loss`` plus the terms outside it (the shares, all-reduced); adds the
    hard-negative share to ``terms.stats`` (one all-reduce) when the tiles counted them."""
    nontarget = terms.nontarget
    if nontarget is not None and nontarget.hard_rows is not None:
        hard = dist_ops.all_reduce(nontarget.hard_rows.double().sum(), group)
        pairs = glob.negatives * glob.target_cos.numel()
        terms.stats[names.HARD_NEGATIVE_SHARE] = torch.where(pairs > 0, hard / pairs, math.nan)
    if not terms.shares:
        return loss
    totals = dist_ops.all_reduce(torch.stack(list(terms.shares.values())), group)
    terms.stats.update(zip(terms.shares, totals.detach().unbind(), strict=True))
    return loss + totals.sum()
