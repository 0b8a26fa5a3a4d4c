"""What a checkpoint holds (the plan; ``trainer.checkpoint`` is the storage): the engine's
state as flat name -> tensor entries, from ``Engine.state_dict()`` by section
(``trainer.engine.state.EngineState``: each entry a replicated tensor or this rank's
:class:`~trainer.engine.state.Rows` of a row-sharded one).

The backbone's optimizer state is its engine's to name (``engine.backend``:
``optimizer_state`` / ``load_optimizer_state`` of ``trainer.engine.backend.BackboneBackend``):
DDP's is a torch optimizer's, DeepSpeed ZeRO/bf16 gathers its partitions into full form
(``trainer.engine.deepspeed_backend``, the one place that touches DeepSpeed internals).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.dist import DistEnv
from trainer.engine.state import EngineState, Rows

__all__ = ["Rows", "average_buffers", "collect", "restore"]


def average_buffers(module: torch.nn.Module, env: DistEnv) -> None:
    """Replace every floating-point buffer (BatchNorm running mean/var) by its mean over the
    ranks, in place (collective).

    Data-parallel ranks (``env.group``) see different images, so their running statistics
    differ; a checkpoint holds one copy. The mean is the statistic of all ranks' data (exact for the
    running mean, which is linear in the batches; the usual non-SyncBN estimate for the
    variance), where any one rank's copy saw 1/P of it. Written back into the live module,
    so evaluation after a save, ``backbone.pt``, the DCP copy and a resumed run all agree.
    """
    for buffer in module.buffers():
        if buffer.is_floating_point():
            total = buffer.detach().double()
            dist.all_reduce(total, group=env.group)
            buffer.copy_(total / env.world_size)


def collect(engine) -> dict[str, torch.Tensor | Rows]:
    """The full state of ``engine``, flat; collective (every rank calls it): the backbone's
    buffers are averaged over the ranks first (:func:`average_buffers`)."""
    with torch.no_grad():
        average_buffers(engine.backbone, engine.env)
    return engine.state_dict().flat()


def restore(engine, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` (as :func:`collect` named it, rows already this rank's) into ``engine``."""
    engine.load_state_dict(EngineState.from_flat(state))
