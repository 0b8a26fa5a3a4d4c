"""The training step: backbone (DDP or DeepSpeed), head and their optimizers (``engine``)."""

from trainer.engine.engine import Engine, lr_factor, make_head_optimizer, make_optimizer

__all__ = ["Engine", "lr_factor", "make_head_optimizer", "make_optimizer"]
