"""The head's statistics of the global batch: one no-grad all-reduce per forward.

``partial_fc.head.PartialFC.forward`` computes its shard's tile statistics and the softmax;
what it needs from *all* shards besides the loss is here: the target cosines of the global
batch (for ``theta_med``), the number of sampled classes (to rescale sampled non-target sums
to all ``C - 1`` negatives), the sum of non-target cosines, and for dynamic AdaCos each
sample's partial ``B`` (arXiv:1905.00292 Sec. 4.2), which :func:`global_stats` turns into
the new scale. :func:`stats_readout` packs the replicated results into ``PartialFC.stats``
without reading the device. Kept apart from the head so that the forward reads as data
flow; it is called on every rank of the head's process group (a collective).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from partial_fc import distributed as dist_ops
from partial_fc import metric_names as names
from partial_fc.readout import DeviceScalars
from partial_fc.scale import AdaCosScale, log_mean_exp, median_angle
from partial_fc.softmax import Shard

__all__ = ["GlobalStats", "global_stats", "stats_readout"]


@dataclass(frozen=True)
class GlobalStats:
    """:func:`global_stats`' replicated results (the same on every rank of the group).

    ``target_cos`` ``[N]`` fp32 (each sample's target cosine, from the rank owning its
    class); ``theta_med`` the median target angle (rad); ``neg_ratio`` ``(C - 1) / (S - 1)``
    (NaN when ``S == 1``); ``nontarget_cos_sum`` the sum of sampled non-target cosines;
    ``negatives`` ``S - 1``; ``log_b_avg`` ``ln B_avg`` at the previous scale when a dynamic
    AdaCos step updated it, else None. All 0-d device tensors unless said.
    """

    target_cos: Tensor
    theta_med: Tensor
    neg_ratio: Tensor
    nontarget_cos_sum: Tensor
    negatives: Tensor
    log_b_avg: Tensor | None


@torch.no_grad()
def global_stats(shard: Shard, row_max: Tensor, row_sum: Tensor, cos_sum: Tensor,
                 scale: torch.nn.Module, num_classes: int, training: bool,
                 process_group: dist_ops.ProcessGroup) -> GlobalStats:
    """One all-reduce (fp64) of: each sample's target cos, each sample's partial
    ``sum_{k != y} exp(s_prev (cos_k - 1))`` (dynamic AdaCos only, from the tile statistics
    at ``s_prev``), the number of sampled classes and the sum of non-target cosines.
    ``scale`` is the margin's scale, ``s_prev = scale.value()`` on entry, updated here when it
    is a dynamic AdaCos scale and ``training``; ``row_max, row_sum, cos_sum`` ``[N]`` are
    ``shard.stats(s_prev)``.
    Everything stays on the device: the total of sampled classes (``S``, known to the host
    only at ``r == 1``) enters ``neg_ratio = (C - 1) / (S - 1)`` as a tensor, NaN when
    ``S == 1`` (no negative at all), and a dynamic scale keeps its value then.

    Returns a :class:`GlobalStats`."""
    n, sampled = shard.e.shape[0], shard.w.shape[0]
    s_prev = scale.value()
    dynamic = isinstance(scale, AdaCosScale) and scale.dynamic and training
    packed = torch.zeros(2 * n + 2, dtype=torch.float64, device=row_max.device)
    packed[:n] = shard.cos_t.double()  # 0 on rows whose target another rank owns
    if dynamic:  # exp(row_max - s_prev) <= ~1 (cos <= 1): no overflow whatever s is
        packed[n: 2 * n] = (row_sum * torch.exp(row_max - s_prev)).double()
    packed[2 * n].fill_(sampled)  # a kernel argument: `packed[i] = int` is a host copy
    packed[2 * n + 1] = cos_sum.double().sum()
    packed = dist_ops.all_reduce(packed, process_group)
    target_cos, total = packed[:n].float(), packed[2 * n]
    neg_ratio = torch.where(total > 1, (num_classes - 1) / (total - 1), math.nan)
    theta_med = median_angle(target_cos)
    log_b_avg = None
    if dynamic:  # B estimated from the sampled negatives, rescaled
        log_b_avg = log_mean_exp(s_prev.double() + torch.log(packed[n: 2 * n] * neg_ratio))
        scale.update(log_b_avg.float(), theta_med, valid=total > 1)
    return GlobalStats(target_cos, theta_med, neg_ratio, packed[2 * n + 1], total - 1,
                       log_b_avg)


def stats_readout(loss: Tensor, glob: GlobalStats, b_sums: Tensor, shift: Tensor,
                  s: Tensor | float, extra: dict[str, Tensor] | None = None) -> DeviceScalars:
    """``PartialFC.stats`` from replicated tensors only (so identical on all ranks), read by
    the host only when a value is asked for (``partial_fc.readout``). ``glob`` is
    :func:`global_stats`'s result; ``b_sums`` ``[N]`` the softmax's non-target sums of
    ``exp(z - shift)`` rescaled to all classes, ``s`` the scale the loss used; ``extra``
    further replicated 0-d statistics, passed through by name."""
    extra = extra or {}
    log_b_avg = glob.log_b_avg
    if log_b_avg is None:  # B at the current s, from the softmax's non-target sums
        log_b_avg = log_mean_exp(torch.log(b_sums.double()) + shift.double())
    return DeviceScalars({
        "loss": loss.detach(), "theta_med": glob.theta_med, "log_b_avg": log_b_avg,
        "cos_target_mean": glob.target_cos.double().mean(),
        "scale": s,  # a fixed scale's float stays one (a tensor of it is a host copy)
        "nontarget_cos_sum": glob.nontarget_cos_sum, "negatives": glob.negatives, **extra,
    }, functools.partial(_host_stats, glob.target_cos.numel(), tuple(extra)))


def _host_stats(n: int, extra: tuple[str, ...], raw: dict[str, float]) -> dict[str, float]:
    """The ``stats`` floats from the values read off the device (``n`` = global batch)."""
    neg = raw["negatives"]
    return {
        names.SCALE: raw["scale"], names.THETA_MED: raw["theta_med"],
        names.B_AVG: math.exp(min(raw["log_b_avg"], 709.0)), names.LOSS: raw["loss"],
        names.COS_TARGET_MEAN: raw["cos_target_mean"],
        names.COS_NONTARGET_MEAN: raw["nontarget_cos_sum"] / (n * neg) if neg else math.nan,
        **{k: raw[k] for k in extra},
    }
