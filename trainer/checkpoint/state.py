"""What a checkpoint holds (the plan; ``trainer.checkpoint`` is the storage).

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
needs the (lazily created) optimizer state to exist: :func:`restore` creates it first
through :class:`ZeroPartitions`, the one place that touches DeepSpeed internals.
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


class ZeroPartitions:
    """The one place ``launch`` touches DeepSpeed internals (DeepSpeed 0.19).

    ZeRO-1/2 and the bf16 optimizer keep the backbone's fp32 master weights and optimizer
    state as flat per-group partitions. DeepSpeed's public tensor-fragment API
    (``deepspeed.utils.safe_get/set_full_*``) reads and writes them per parameter, but there
    is no public call that creates the optimizer state before the first step, which a resume
    must fill: that needs the partitions and their parameter groups, named below.
    ``tests/test_checkpoint.py::test_deepspeed_internals_are_where_launch_state_expects``
    fails loudly when an installed DeepSpeed moves them.
    """

    FLAT = ("single_partition_of_fp32_groups", "fp32_groups_flat_partition")
    GROUPS = ("bit16_groups", "bf16_groups")

    def __init__(self, zero_optimizer):
        import deepspeed

        self.base = zero_optimizer.optimizer  # the wrapped torch optimizer
        names = [n for n in (*self.FLAT, *self.GROUPS) if hasattr(zero_optimizer, n)]
        if len(names) != 2:
            raise TypeError(f"DeepSpeed {deepspeed.__version__}: {type(zero_optimizer).__name__} "
                            f"has not the partitions trainer.checkpoint.state reads ({self.FLAT}, "
                            f"{self.GROUPS}); see trainer/checkpoint/state.py ZeroPartitions")
        self.flat = list(getattr(zero_optimizer, names[0]))
        self.groups = list(getattr(zero_optimizer, names[1]))

    @classmethod
    def of(cls, engine) -> ZeroPartitions | None:
        """The partitions of ``engine``'s DeepSpeed optimizer, or None when its state is a
        plain torch optimizer's (DDP, DeepSpeed without ZeRO in fp32)."""
        if not engine.deepspeed:
            return None
        params = list(_trainable(engine).values())
        # Every rank's parameters carry the attribute (None where another rank holds the
        # fragment), so every rank takes the same branch.
        linked = bool(params) and hasattr(params[0], "_hp_mapping")
        return cls(engine.model.optimizer) if linked else None

    def state_keys(self) -> tuple[list[str], dict[str, torch.Tensor]]:
        """(names of the per-element state tensors, the scalar state such as Adam's step)."""
        state0 = self.base.state.get(self.flat[0], {})
        shape = self.flat[0].shape
        keys = [k for k, v in state0.items() if torch.is_tensor(v) and v.shape == shape]
        return keys, {k: torch.as_tensor(v) for k, v in state0.items() if k not in keys}

    def link_state(self) -> None:
        """Point every parameter's fragment at its partition's optimizer state. DeepSpeed
        0.19's ZeRO-1/2 links them after stepping its *first* parameter group only, so with
        several groups (``optim.decay=weights``) the later groups' fragments stay empty and
        ``safe_get_full_optimizer_state`` fails for them; linking again is cheap (views)."""
        from deepspeed.utils import lazy_init_hp_params_optimizer_state

        for flat, group in zip(self.flat, self.groups, strict=True):
            if flat in self.base.state:
                lazy_init_hp_params_optimizer_state(group, flat, self.base.state)

    def create_state(self, keys: list[str], scalars: dict[str, torch.Tensor]) -> None:
        """Zero optimizer state for every partition, linked to the parameters' fragments, so
        ``safe_set_full_optimizer_state`` can fill it (DeepSpeed builds it lazily at the
        first step otherwise)."""
        from deepspeed.utils import lazy_init_hp_params_optimizer_state

        for flat, group in zip(self.flat, self.groups, strict=True):
            self.base.state[flat] = {k: torch.zeros_like(flat) for k in keys}
            self.base.state[flat].update({k: v.clone() for k, v in scalars.items()})
            lazy_init_hp_params_optimizer_state(group, flat, self.base.state)


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
    zero = ZeroPartitions.of(engine)
    if zero is None:
        for name, p in engine.backbone.named_parameters():
            for key, value in engine.optimizer.state.get(p, {}).items():
                out[f"backbone_opt.{name}.{key}"] = torch.as_tensor(value)
        return out
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    zero.link_state()
    keys, scalars = zero.state_keys()
    out.update({f"backbone_opt_scalar.{k}": v for k, v in scalars.items()})
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
    zero = ZeroPartitions.of(engine)
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
    zero.create_state(keys, scalars)
    for name, p in names.items():
        safe_set_full_fp32_param(p, state[f"backbone_fp32.{name}"].to(p.device))
        for key in keys:
            safe_set_full_optimizer_state(p, state[f"backbone_opt.{name}.{key}"].to(p.device), key)
