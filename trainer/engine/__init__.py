"""The training step: backbone (DDP or DeepSpeed), head and their optimizers (``engine``)."""

from trainer.engine.engine import (
    Engine,
    decay_groups,
    lr_factor,
    make_head_optimizer,
    make_optimizer,
)

__all__ = ["Engine", "decay_groups", "lr_factor", "make_head_optimizer", "make_optimizer"]
