"""What a checkpoint holds (the plan; ``trainer.checkpoint`` is the storage).

Every piece of training state becomes one flat name -> tensor entry of one of two kinds:

* :class:`Rows` — this rank's block ``[offset, offset + n)`` of a ``[num_classes * K, ...]``
  tensor (``K`` sub-centers per class, class-major: a class's rows stay together): the
  head's weight rows and every per-row tensor of the head's optimizer. Saved as one logical
  tensor, so a run resumed on any number of ranks reads exactly its rows.
* a plain tensor, identical on every rank (replicated): the backbone's weights, its fp32
  master copy and optimizer state in *full* (un-partitioned) form, the head's scale state
  and any scalar optimizer state. Full form is what makes ZeRO-1/2 state reshardable.

The backbone's optimizer state is its engine's to name (``engine.backend``:
``optimizer_state`` / ``load_optimizer_state`` of ``trainer.engine.backend.BackboneBackend``):
DDP's is a torch optimizer's, DeepSpeed ZeRO/bf16 gathers its partitions into full form
(``trainer.engine.deepspeed_backend``, the one place that touches DeepSpeed internals).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.dist import DistEnv


@dataclass(frozen=True)
class Rows:
    """Rows ``[offset, offset + local.shape[0])`` of a tensor with ``total`` rows."""

    local: torch.Tensor
    offset: int
    total: int


def _head_opt_state(engine) -> dict:
    return engine.head_optimizer.state.setdefault(engine.head.weight, {})


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
    """The full state of ``engine``; collective (every rank calls it): the backbone's
    buffers are averaged over the ranks first (:func:`average_buffers`)."""
    head = engine.head
    with torch.no_grad():
        average_buffers(engine.backbone, engine.env)
    out: dict[str, torch.Tensor | Rows] = {}
    start, total = head.row_start, head.num_classes * head.subcenters  # weight rows
    for key, value in head.state_dict().items():
        out[f"head.{key}"] = Rows(value, start, total) if key == "weight" else value
    for key, value in _head_opt_state(engine).items():
        value = torch.as_tensor(value)
        per_row = value.ndim >= 1 and value.shape[0] == head.weight.shape[0]
        out[f"head_opt.{key}"] = Rows(value, start, total) if per_row else value
    for key, value in engine.backbone.state_dict().items():
        out[f"backbone.{key}"] = value
    out.update(engine.backend.optimizer_state())
    return out


def restore(engine, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` (as :func:`collect` named it, rows already this rank's) into ``engine``."""
    head = engine.head

    def section(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}

    head.load_state_dict(section("head."))
    head_opt = _head_opt_state(engine)
    head_opt.clear()
    head_opt.update({k: v.to(head.weight.device) for k, v in section("head_opt.").items()})
    engine.backbone.load_state_dict(section("backbone."))
    engine.backend.load_optimizer_state(state)
