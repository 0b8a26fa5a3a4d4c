"""The optimizers and the learning-rate schedule of a run: the backbone's torch optimizer (its
weight-decay groups), the head's row-sampling twin (``partial_fc.optim``) with the same
hyper-parameters, and the ``step -> lr multiplier`` both follow."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from partial_fc.optim import SampledAdamW, SampledSGD
from trainer.config import OptimConfig, ScheduleConfig


def lr_factor(schedule: ScheduleConfig, warmup_steps: int, total_steps: int) -> Callable:
    """``step -> lr multiplier``: linear warm-up to 1, then ``(1 - t)^power`` or cosine to 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule.type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * t))
        return (1.0 - t) ** schedule.power

    return factor


def _optimizer_kwargs(optim: OptimConfig) -> dict:
    """The hyper-parameters both optimizers share, besides ``lr``."""
    if optim.name == "sgd":
        return {"momentum": optim.momentum, "weight_decay": optim.weight_decay}
    return {"betas": tuple(optim.betas), "eps": optim.eps, "weight_decay": optim.weight_decay}


def decay_groups(optim: OptimConfig, backbone: nn.Module) -> list[dict]:
    """The backbone's trainable parameters as optimizer groups. ``optim.decay=all``: one group.
    ``weights``: a second group without weight decay for every parameter of at most one
    dimension (normalisation scales and shifts, biases, PReLU slopes) and those the model
    names in ``no_weight_decay()`` (timm's convention: position embeddings, tokens), as in
    AdamW's usual ViT recipe (Loshchilov & Hutter, arXiv 1711.05101, decoupled decay)."""
    params = [(n, p) for n, p in backbone.named_parameters() if p.requires_grad]
    if optim.decay == "all":
        return [{"params": [p for _, p in params]}]
    skip = set(getattr(backbone, "no_weight_decay", set)())
    plain = [p for n, p in params if p.ndim <= 1 or n in skip]
    decayed = [p for n, p in params if not (p.ndim <= 1 or n in skip)]
    groups = [{"params": decayed}, {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # DeepSpeed cannot flatten an empty group


def make_optimizer(optim: OptimConfig, backbone: nn.Module) -> torch.optim.Optimizer:
    """The backbone's torch optimizer (its parameter groups: :func:`decay_groups`)."""
    cls = torch.optim.SGD if optim.name == "sgd" else torch.optim.AdamW
    return cls(decay_groups(optim, backbone), lr=optim.lr, **_optimizer_kwargs(optim))


def make_head_optimizer(optim: OptimConfig, weight: nn.Parameter, max_update_bytes: int,
                        dense: bool = False, fused: bool = True) -> torch.optim.Optimizer:
    """The optimizer of the head's ``weight``, row-sampling (unsampled rows get no momentum,
    no decay, unless ``dense``: ``head.update``): it steps from the head's
    ``pop_sampled_rows()``. ``fused``: SGD's step over every row in one fused kernel
    (``partial_fc.optim.SampledSGD``; ``engine.fused_updates``)."""
    if optim.name == "sgd":
        return SampledSGD(weight, optim.lr, **_optimizer_kwargs(optim),
                          max_update_bytes=max_update_bytes, dense=dense, fused=fused)
    return SampledAdamW(weight, optim.lr, **_optimizer_kwargs(optim),
                        max_update_bytes=max_update_bytes, dense=dense)
