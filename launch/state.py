"""What a checkpoint holds (the plan; ``launch.checkpoint`` is the storage).

Every piece of training state becomes one flat name -> tensor entry of one of two kinds:

* :class:`Rows` — this rank's block ``[offset, offset + n)`` of a ``[num_classes, ...]``
  tensor: the head's weight rows and every per-row tensor of the head's optimizer. Saved
  as one logical tensor, so a run resumed on any number of ranks reads exactly its rows.
* a plain tensor, identical on every rank (replicated): the backbone's weights, its fp32
  master copy and optimizer state in *full* (un-partitioned) form, the head's scale state
  and any scalar optimizer state. Full form is what makes ZeRO-1/2 state reshardable.

DeepSpeed ZeRO/bf16 keeps the backbone's fp32 master weights and optimizer state
partitioned; they are read and written through DeepSpeed's tensor-fragment API
(``safe_get_full_optimizer_state`` & co., collective over the data-parallel group), which
needs the (lazily created) optimizer state to exist: :func:`restore` creates it first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rows:
    """Rows ``[offset, offset + local.shape[0])`` of a tensor with ``total`` rows."""

    local: torch.Tensor
    offset: int
    total: int


def _head_opt_state(engine) -> dict:
    return engine.head_optimizer.state.setdefault(engine.head.weight, {})


def _zero_optimizer(engine):
    """The DeepSpeed optimizer that partitions fp32 state, or None (plain torch optimizer)."""
    if not engine.deepspeed:
        return None
    params = list(_trainable(engine).values())
    return engine.model.optimizer if params and hasattr(params[0], "_hp_mapping") else None


def _flat_partitions(zero_opt) -> list[torch.Tensor]:
    for attr in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
        if hasattr(zero_opt, attr):
            return list(getattr(zero_opt, attr))
    raise TypeError(f"unsupported DeepSpeed optimizer {type(zero_opt).__name__}")


def _trainable(engine) -> dict[str, torch.nn.Parameter]:
    """Backbone parameters the optimizer owns (frozen ones live in the state_dict only)."""
    return {n: p for n, p in engine.backbone.named_parameters() if p.requires_grad}


def average_buffers(module: torch.nn.Module) -> None:
    """Replace every floating-point buffer (BatchNorm running mean/var) by its mean over the
    ranks, in place (collective).

    Data-parallel ranks see different images, so their running statistics differ; a
    checkpoint holds one copy. The mean is the statistic of all ranks' data (exact for the
    running mean, which is linear in the batches; the usual non-SyncBN estimate for the
    variance), where any one rank's copy saw 1/P of it. Written back into the live module,
    so evaluation after a save, ``backbone.pt``, the DCP copy and a resumed run all agree.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    for buffer in module.buffers():
        if buffer.is_floating_point():
            total = buffer.detach().double()
            dist.all_reduce(total)
            buffer.copy_(total / world)


def collect(engine) -> dict[str, torch.Tensor | Rows]:
    """The full state of ``engine``; collective (every rank calls it): the backbone's
    buffers are averaged over the ranks first (:func:`average_buffers`)."""
    head = engine.head
    with torch.no_grad():
        average_buffers(engine.backbone)
    out: dict[str, torch.Tensor | Rows] = {}
    for key, value in head.state_dict().items():
        out[f"head.{key}"] = (
            Rows(value, head.class_start, head.num_classes) if key == "weight" else value
        )
    for key, value in _head_opt_state(engine).items():
        value = torch.as_tensor(value)
        per_row = value.ndim >= 1 and value.shape[0] == head.num_local
        out[f"head_opt.{key}"] = (
            Rows(value, head.class_start, head.num_classes) if per_row else value
        )
    for key, value in engine.backbone.state_dict().items():
        out[f"backbone.{key}"] = value
    zero = _zero_optimizer(engine)
    if zero is None:
        for name, p in engine.backbone.named_parameters():
            for key, value in engine.optimizer.state.get(p, {}).items():
                out[f"backbone_opt.{name}.{key}"] = torch.as_tensor(value)
        return out
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    base_state = zero.optimizer.state
    flat = _flat_partitions(zero)
    state0 = base_state.get(flat[0], {})
    keys = [k for k, v in state0.items() if torch.is_tensor(v) and v.shape == flat[0].shape]
    for key, value in state0.items():
        if key not in keys:
            out[f"backbone_opt_scalar.{key}"] = torch.as_tensor(value)
    for name, p in _trainable(engine).items():
        out[f"backbone_fp32.{name}"] = safe_get_full_fp32_param(p).cpu()
        for key in keys:
            out[f"backbone_opt.{name}.{key}"] = safe_get_full_optimizer_state(p, key).cpu()
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
    zero = _zero_optimizer(engine)
    opt_state = section("backbone_opt.")
    if zero is None:
        for name, p in engine.backbone.named_parameters():
            mine = {k[len(name) + 1 :]: v for k, v in opt_state.items() if k.startswith(name + ".")}
            if mine:
                engine.optimizer.state[p] = {k: v.to(p.device) for k, v in mine.items()}
        return
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    scalars = section("backbone_opt_scalar.")
    names = _trainable(engine)
    keys = sorted({k.rsplit(".", 1)[1] for k in opt_state})
    for flat in _flat_partitions(zero):  # create the lazily-built state so it can be filled
        zero.optimizer.state[flat] = {k: torch.zeros_like(flat) for k in keys}
        zero.optimizer.state[flat].update({k: v.clone() for k, v in scalars.items()})
    zero._hp_optimizer_states_linked = False
    zero._lazy_init_hp_params_optimizer_state()
    for name, p in names.items():
        safe_set_full_fp32_param(p, state[f"backbone_fp32.{name}"].to(p.device))
        for key in keys:
            safe_set_full_optimizer_state(p, state[f"backbone_opt.{name}.{key}"].to(p.device), key)
