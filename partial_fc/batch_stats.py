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

import torch
from torch import Tensor

from partial_fc import distributed as dist_ops
from partial_fc.readout import DeviceScalars
from partial_fc.scale import AdaCosScale, log_mean_exp, median_angle
from partial_fc.softmax import Shard

__all__ = ["global_stats", "stats_readout"]


@torch.no_grad()
def global_stats(shard: Shard, row_max: Tensor, row_sum: Tensor, cos_sum: Tensor,
                 scale: torch.nn.Module, num_classes: int, training: bool,
                 process_group: dist_ops.ProcessGroup) -> dict:
    """One all-reduce (fp64) of: each sample's target cos, each sample's partial
    ``sum_{k != y} exp(s_prev (cos_k - 1))`` (dynamic AdaCos only, from the tile statistics
    at ``s_prev``), the number of sampled classes and the sum of non-target cosines.
    ``scale`` is the margin's scale, ``s_prev = scale.value()`` on entry, updated here when it
    is a dynamic AdaCos scale and ``training``; ``row_max, row_sum, cos_sum`` ``[N]`` are
    ``shard.stats(s_prev)``.
    Everything stays on the device: the total of sampled classes (``S``, known to the host
    only at ``r == 1``) enters ``neg_ratio = (C - 1) / (S - 1)`` as a tensor, NaN when
    ``S == 1`` (no negative at all), and a dynamic scale keeps its value then.

    Returns ``target_cos`` ``[N]`` fp32, ``theta_med`` (rad), ``neg_ratio``,
    ``nontarget_cos_sum``, ``negatives`` (``S - 1``) and ``log_b_avg`` (``ln B_avg`` at
    ``s_prev`` when the scale was updated, else None): replicated 0-d tensors."""
    n, sampled = shard.e.shape[0], shard.w.shape[0]
    s_prev = scale.value()
    dynamic = isinstance(scale, AdaCosScale) and scale.dynamic and training
    packed = torch.zeros(2 * n + 2, dtype=torch.float64, device=row_max.device)
    packed[:n] = shard.cos_t.double()  # 0 on rows whose target another rank owns
    if dynamic:  # exp(row_max - s_prev) <= ~1 (cos <= 1): no overflow whatever s is
        packed[n: 2 * n] = (row_sum * torch.exp(row_max - s_prev)).double()
    packed[2 * n] = sampled
    packed[2 * n + 1] = cos_sum.double().sum()
    packed = dist_ops.all_reduce(packed, process_group)
    target_cos, total = packed[:n].float(), packed[2 * n]
    neg_ratio = torch.where(total > 1, (num_classes - 1) / (total - 1), math.nan)
    theta_med = median_angle(target_cos)
    out = {"target_cos": target_cos, "theta_med": theta_med, "neg_ratio": neg_ratio,
           "nontarget_cos_sum": packed[2 * n + 1], "negatives": total - 1,
           "log_b_avg": None}
    if dynamic:  # B estimated from the sampled negatives, rescaled
        log_b = s_prev.double() + torch.log(packed[n: 2 * n] * neg_ratio)
        out["log_b_avg"] = log_mean_exp(log_b)
        scale.update(out["log_b_avg"].float(), theta_med, valid=total > 1)
    return out


def stats_readout(loss: Tensor, glob: dict, b_sums: Tensor, shift: Tensor,
                  s: Tensor | float) -> DeviceScalars:
    """``PartialFC.stats`` from replicated tensors only (so identical on all ranks), read by
    the host only when a value is asked for (``partial_fc.readout``). ``glob`` is
    :func:`global_stats`'s result; ``b_sums`` ``[N]`` the softmax's non-target sums of
    ``exp(z - shift)`` rescaled to all classes, ``s`` the scale the loss used."""
    log_b_avg = glob["log_b_avg"]
    if log_b_avg is None:  # B at the current s, from the softmax's non-target sums
        log_b_avg = log_mean_exp(torch.log(b_sums.double()) + shift.double())
    return DeviceScalars({
        "loss": loss.detach(), "theta_med": glob["theta_med"], "log_b_avg": log_b_avg,
        "cos_target_mean": glob["target_cos"].double().mean(),
        "scale": s,  # a fixed scale's float stays one (a tensor of it is a host copy)
        "nontarget_cos_sum": glob["nontarget_cos_sum"], "negatives": glob["negatives"],
    }, functools.partial(_host_stats, glob["target_cos"].numel()))


def _host_stats(n: int, raw: dict[str, float]) -> dict[str, float]:
    """The ``stats`` floats from the values read off the device (``n`` = global batch)."""
    neg = raw["negatives"]
    return {
        "scale": raw["scale"], "theta_med": raw["theta_med"],
        "b_avg": math.exp(min(raw["log_b_avg"], 709.0)), "loss": raw["loss"],
        "cos_target_mean": raw["cos_target_mean"],
        "cos_nontarget_mean": raw["nontarget_cos_sum"] / (n * neg) if neg else math.nan,
    }
