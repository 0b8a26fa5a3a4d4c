"""The training step: the backbone's engine (DDP or DeepSpeed, behind ``BackboneBackend``),
the head and their optimizers (``engine``)."""

from trainer.engine.backend import BackboneBackend
from trainer.engine.engine import (
    BACKENDS,
    Engine,
    StepResult,
    decay_groups,
    lr_factor,
    make_head_optimizer,
    make_optimizer,
)

__all__ = ["BACKENDS", "BackboneBackend", "Engine", "StepResult", "decay_groups", "lr_factor",
           "make_head_optimizer", "make_optimizer"]
