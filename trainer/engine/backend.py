"""The backbone's data-parallel engine behind one small Protocol (DDP, DeepSpeed).

``trainer.engine.Engine`` runs the head and the step's order the same way for every
backbone engine; a :class:`BackboneBackend` owns what differs between them: how the
backbone is wrapped (``model``), the precision its forward runs in, its backward, gradient
clipping and norm, whether and when its optimizer steps (and how it tells a dropped step),
and the form its optimizer state takes in a checkpoint. The implementations are
``trainer.engine.ddp.DDPBackend`` and ``trainer.engine.deepspeed_backend.DeepSpeedBackend``;
another engine (FSDP) is one more file implementing this Protocol, one entry in
``trainer.engine.engine.BACKENDS`` and its name in ``engine.type``.

One step, as ``Engine.step`` calls it on every rank (``k`` micro-batches)::

    for each micro-batch:  with backend.micro_batch(boundary):
                               with backend.autocast(): emb = backend.model(x)
                               ... the head's forward and backward, the surrogate ...
                               backend.backward(surrogate)              (micro-batches 1..k-1)
                               pending = backend.last_backward(surrogate, step, agree)  (k)
    flags = pending.flags.tolist()                                      (the one host read)
    update = backend.update(pending, finite)

``agree`` is the engine's one all-reduce of the step's flags (:data:`Agree`); each backend
calls it once, inside :meth:`BackboneBackend.last_backward`, where it can still cancel its
update without a host read: DDP after its backward (the gradient norm joins the vote),
DeepSpeed before (a bad step's surrogate is NaN-ed, and DeepSpeed's own overflow check
drops it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

Agree = Callable[[Tensor | None], Tensor]
"""``agree(backbone_finite)`` -> int32 ``[all finite, labels in range, -stop request]`` on the
device, the same on every rank (one all-reduce, no host read). ``backbone_finite`` (a 0-d
bool tensor, or None) joins the engine's own finite flag (the loss, the embedding and head
gradients)."""


@dataclass(frozen=True)
class Pending:
    """What the last micro-batch's backward leaves for the step's one host read."""

    flags: Tensor  # the agreed flags (:data:`Agree`)
    grad_norm: Tensor | float  # the backbone's gradient norm (before clipping), on the device
    dropped: bool  # the backend already declined its update (DeepSpeed's overflow check)


@dataclass(frozen=True)
class Update:
    """Whether the backbone's update of this step was applied; the head follows it."""

    applied: bool
    overflow: bool  # not applied for the fp16 loss scaler alone: a normal skip, not a bad step


@runtime_checkable
class BackboneBackend(Protocol):
    """The data-parallel engine of the backbone, built on every rank of ``env.group``.

    Constructed as ``Backend(cfg, module, backbone, optimizer, env)``: ``module`` is what it
    runs (the backbone, or its ``torch.compile`` sharing its parameters), ``backbone`` the
    bare module whose parameters it trains with the torch ``optimizer``.
    """

    model: nn.Module  # the wrapped module the forward is called on
    input_dtype: torch.dtype  # the dtype the images must have (DeepSpeed: its parameters')

    def micro_batch(self, boundary: bool) -> AbstractContextManager:
        """Context of one micro-batch's forward and backward; ``boundary``: the step's last
        (DDP reduces the gradients only there)."""
        ...

    def autocast(self) -> AbstractContextManager:
        """Context of the backbone's forward (DDP's bf16 autocast)."""
        ...

    def backward(self, surrogate: Tensor) -> None:
        """Backward of a micro-batch before the last: gradients accumulate, nothing steps."""
        ...

    def last_backward(self, surrogate: Tensor, step: int, agree: Agree) -> Pending:
        """Backward of the last micro-batch and the gradient norm (clipped to
        ``train.clip_grad_norm``); calls ``agree`` once. ``step`` (0-based) names the step
        in an error."""
        ...

    def update(self, pending: Pending, finite: bool) -> Update:
        """The backbone's update now that the ranks agreed whether the step is ``finite``;
        the gradients are cleared either way."""
        ...

    def optimizer_state(self) -> dict[str, Tensor]:
        """The backbone optimizer's state in full (un-partitioned) form, replicated, as flat
        checkpoint entries (``trainer.checkpoint.state``); collective."""
        ...

    def load_optimizer_state(self, state: Mapping[str, Tensor]) -> None:
        """Load what :meth:`optimizer_state` named (``state`` may hold other entries too);
        collective."""
        ...


def torch_optimizer_state(backbone: nn.Module, optimizer: torch.optim.Optimizer
                          ) -> dict[str, Tensor]:
    """A plain torch optimizer's per-parameter state as ``backbone_opt.<param>.<key>``."""
    return {f"backbone_opt.{name}.{key}": torch.as_tensor(value)
            for name, p in backbone.named_parameters()
            for key, value in optimizer.state.get(p, {}).items()}


def load_torch_optimizer_state(backbone: nn.Module, optimizer: torch.optim.Optimizer,
                               state: Mapping[str, Tensor]) -> None:
    """Put :func:`torch_optimizer_state`'s entries back, on each parameter's device."""
    for name, p in backbone.named_parameters():
        prefix = f"backbone_opt.{name}."
        mine = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if mine:
            optimizer.state[p] = {k: v.to(p.device) for k, v in mine.items()}
