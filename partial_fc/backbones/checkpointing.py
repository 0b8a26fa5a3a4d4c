"""Activation checkpointing of a backbone's blocks, exact: the same loss and gradients.

``torch.utils.checkpoint`` (non-reentrant) keeps only a checkpointed block's input and runs
its forward again during the backward (Chen et al., "Training Deep Nets with Sublinear Memory
Cost", arXiv 1604.06174). Three things would make the recomputed block differ from the first
run, and each is handled:

* random draws (dropout, stochastic depth): ``torch.utils.checkpoint`` saves the RNG state
  before the block and restores it for the recomputation (``preserve_rng_state=True``, its
  default);
* BatchNorm's running statistics (iResNet blocks): a training-mode forward updates them, so a
  recomputation would update them twice. The recomputation runs under
  :func:`_frozen_running_stats`, which makes every :mod:`partial_fc.backbones.norm` module in
  the block normalise with the batch statistics (as the first run did) without updating the
  running ones;
* under ``torch.compile`` the compiler recomputes the region inside its own backward graph,
  where the statistics' update is applied once; the recompute context is not passed there
  (dynamo accepts only its own ``context_fn``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from partial_fc.backbones.norm import FreezableStats


def checkpoint_errors(every: int) -> list[str]:
    """Why ``every`` is not a valid checkpointing interval (empty when it is)."""
    if type(every) is not int or every < 0:
        return [f"checkpointing must be an int >= 0 (0 = off, k = every k-th block), "
                f"got {every!r}"]
    return []


def run_blocks(blocks: Sequence[nn.Module], x: Tensor, every: int) -> Tensor:
    """``x`` through ``blocks`` in order; with ``every = k > 0`` the blocks ``0, k, 2k, ...``
    are checkpointed (``k = 1``: every block) while gradients are being recorded. ``every = 0``
    runs them plainly. Each block maps one tensor to one tensor."""
    for i, block in enumerate(blocks):
        if every and i % every == 0 and torch.is_grad_enabled():
            x = _checkpointed(block, x)
        else:
            x = block(x)
    return x


def _checkpointed(block: nn.Module, x: Tensor) -> Tensor:
    if torch.compiler.is_compiling():
        return checkpoint(block, x, use_reentrant=False)

    def contexts() -> tuple[contextlib.AbstractContextManager, ...]:
        return contextlib.nullcontext(), _frozen_running_stats(block)

    return checkpoint(block, x, use_reentrant=False, context_fn=contexts)


@contextlib.contextmanager
def _frozen_running_stats(block: nn.Module) -> Iterator[None]:
    """Inside: the block's BatchNorms leave their running statistics (and their count of
    batches) alone; batch statistics still normalise in training mode."""
    norms = [m for m in block.modules() if isinstance(m, FreezableStats)]
    for m in norms:
        m.freeze_stats = True
    try:
        yield
    finally:
        for m in norms:
            m.freeze_stats = False
