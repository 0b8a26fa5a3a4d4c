"""How long a step would take on a machine without a GPU, before the run starts.

The schema's defaults describe a GPU run (iresnet50 at batch 128); on a CPU one step of it
takes minutes (1.4 min measured, one process, torch 2.13), and a run that says nothing for
that long looks hung. :func:`cpu_pace_warning` estimates the step from the backbone's forward
flops and a CPU training rate calibrated on that measurement; the estimate is meant to tell
seconds from minutes, not to predict a time.
"""

from __future__ import annotations

from trainer.config.machine import Machine
from trainer.config.schema import Config

# Forward GFLOPs per 112x112 image at embedding_size=512 (trainer.plan.backbone_flops, torch's
# FlopCounterMode on the meta device; tests/trainer/test_config_pace.py keeps them in step).
FORWARD_GFLOPS = {
    "iresnet18": 5.22, "iresnet34": 8.92, "iresnet50": 12.62, "iresnet100": 24.18,
    "iresnet200": 46.84, "iresnet_tiny": 0.06, "mobilefacenet": 0.44, "vit_t": 3.01,
    "vit_s": 11.49, "vit_b": 21.56, "vit_l": 47.79, "vit_h": 178.4,
}
# Training flops (forward + backward = 3x forward) a CPU process moves per second:
# iresnet50 at batch 128, one process, 84 s a step.
CPU_TRAIN_FLOPS_PER_S = 3 * 12.62e9 * 128 / 84
WARN_AFTER_S = 60.0  # a planned step longer than this gets a warning


def cpu_step_seconds(cfg: Config, machine: Machine) -> float | None:
    """The estimated seconds of one optimisation step on each rank when the run trains on a
    CPU, None on a GPU or for a backbone whose flops are not tabled (a timm model, a ViT of
    another depth). Ranks on one node share its CPU."""
    if machine.cuda or cfg.device == "cuda":
        return None
    gflops = FORWARD_GFLOPS.get(cfg.backbone.name)
    if gflops is None or getattr(cfg.backbone, "depth", None) is not None:
        return None
    images = cfg.train.batch_size * cfg.train.grad_accum
    return 3 * gflops * 1e9 * images * machine.local_ranks / CPU_TRAIN_FLOPS_PER_S


def cpu_pace_warning(cfg: Config, machine: Machine) -> str | None:
    """A warning when a CPU step would take more than :data:`WARN_AFTER_S`."""
    seconds = cpu_step_seconds(cfg, machine)
    if seconds is None or seconds < WARN_AFTER_S:
        return None
    took = f"{seconds / 60:.1f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"
    return (f"no GPU: one step of {cfg.backbone.name} at train.batch_size={cfg.train.batch_size}"
            f" x grad_accum={cfg.train.grad_accum} on {machine.local_ranks} CPU rank(s) takes "
            f"about {took} here; configs/smoke.yaml (iresnet_tiny) trains on a CPU at seconds a "
            f"step, or run this recipe on a GPU machine")
