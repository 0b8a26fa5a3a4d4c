"""The training step (``engine``): the backbone's engine (DDP or DeepSpeed, behind
``BackboneBackend``) and the head; their optimizers and the lr schedule (``optimizers``)."""

from trainer.engine.backend import BackboneBackend
from trainer.engine.engine import BACKENDS, Engine, StepResult
from trainer.engine.optimizers import decay_groups, lr_factor, make_head_optimizer, make_optimizer

__all__ = ["BACKENDS", "BackboneBackend", "Engine", "StepResult", "decay_groups", "lr_factor",
           "make_head_optimizer", "make_optimizer"]
