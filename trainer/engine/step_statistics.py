"""A ``train.global_batch`` step's statistics, taken before its first forward.

The head's statistics move with each training forward's batch: a dynamic AdaCos scale
(``s_t`` from ``B_avg`` at ``s_{t-1}`` and ``theta_med``), CurricularFace's ``t``, AdaFace's
norm EMAs. A step accumulated over ``k`` passes would move them ``k`` times, each over one
pass's ``P b`` images, so the step would depend on the world size ``P``. Instead, when the
step runs ``k > 1`` passes, the engine first embeds all its micro-batches without grad
(:func:`step_embeddings`, the same model on the same inputs, so the same embeddings as the
passes' own forwards) and hands them to ``PartialFC.begin_step``, which takes the statistics
over the whole step once; the passes then use them as they are. The step equals one forward
of all its images on any world size (DESIGN.md invariants 3 and 9), at the cost of one
forward without grad per micro-batch, paid only by heads whose statistics move
(:func:`moves_statistics`) and only where ``k > 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from trainer.engine.snapshot import Snapshot


def moves_statistics(margin: nn.Module) -> bool:
    """Whether a head's training forwards move its state by their batch's statistics, from
    its ``margin`` (``partial_fc.build_margin``): a dynamic AdaCos scale, or a margin with
    buffers of its own (EMAs)."""
    return bool(getattr(margin.scale, "dynamic", False)) or any(
        not name.startswith("scale.") for name, _ in margin.named_buffers())


def step_embeddings(embed: Callable[..., Tensor], micro_batches: Sequence[tuple],
                    backbone: nn.Module, head: nn.Module, device: torch.device) -> Tensor:
    """This rank's embeddings of the step's micro-batches, ``[k * b, D]`` fp32 in their
    order, by ``embed(images, *flips)`` without grad. Every buffer of ``backbone``
    (BatchNorm's running statistics) and the random streams (dropout) are put back
    afterwards, so the passes that follow run as they would without this forward."""
    saved = Snapshot((backbone,), head)
    devices = [device] if device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        out = [embed(images, *flips).float() for images, _, *flips in micro_batches]
    saved.restore()
    return torch.cat(out)
