"""How long a step would take on a machine without a GPU, before the run starts.

The schema's defaults describe a GPU run (iresnet50 at batch 128); on a CPU one step of it
takes minutes, and a run that says nothing for that long looks hung. :func:`cpu_pace_warning`
estimates the step from the backbone's forward flops and CPU seconds per forward flop, both
measured figures in ``trainer/plan_figures.json`` (``forward_flops``, and ``cpu_pace``: one
iresnet50 step, its machine and command; read by ``trainer.measured_figures``), without
building a model; the estimate is
meant to tell seconds from minutes, not to predict a time.
"""

from __future__ import annotations

from trainer.config.accumulation import accumulation
from trainer.config.machine import Machine
from trainer.config.schema import Config
from trainer.measured_figures import figures

WARN_AFTER_S = 60.0  # a planned step longer than this gets a warning


def cpu_step_seconds(cfg: Config, machine: Machine) -> float | None:
    """The estimated seconds of one optimisation step on each rank when the run trains on a
    CPU, None on a GPU or for a backbone whose flops are not tabled (a timm model, a ViT of
    another depth). Ranks on one node share its CPU."""
    if machine.cuda or cfg.device == "cuda":
        return None
    flops = figures().forward_flops.get(cfg.backbone.name)
    if flops is None or getattr(cfg.backbone, "depth", None) is not None:
        return None
    images = cfg.train.batch_size * accumulation(cfg.train, machine.world_size)
    return flops * images * machine.local_ranks * figures().cpu_train_seconds_per_flop


def cpu_pace_warning(cfg: Config, machine: Machine) -> str | None:
    """A warning when a CPU step would take more than :data:`WARN_AFTER_S`."""
    seconds = cpu_step_seconds(cfg, machine)
    if seconds is None or seconds < WARN_AFTER_S:
        return None
    took = f"{seconds / 60:.1f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"
    k = accumulation(cfg.train, machine.world_size)
    return (f"no GPU: one step of {cfg.backbone.name} at train.batch_size={cfg.train.batch_size}"
            f" x grad_accum={k} on {machine.local_ranks} CPU rank(s) takes "
            f"about {took} here; configs/smoke.yaml (iresnet_tiny) trains on a CPU at seconds a "
            f"step, or run this recipe on a GPU machine")
