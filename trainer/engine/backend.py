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
                               finite = backend.last_backward(surrogate)            (k)
    verdict = Verdict.agree(finite, stop request)         (the step's one all-reduce)
    update = backend.update(verdict, step)          (steps, or drops the step, on its verdict)

The step is decided once, by the engine, in :meth:`Verdict.agree`; a backend only adds its
own finite flag to it (DDP: its gradient norm) and follows it. ``verdict.read()`` is the
step's one host read, cached: whichever of the backend and the engine reads it first pays.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainer.stopping import StopReason, StopRequest


class Verdict:
    """The step's one decision, the same on every rank: whether every loss and gradient was
    finite, and the stop request agreed over the ranks.

    ``flags`` is int32 ``[finite, -stop reason, -signal number]`` on the device, all-reduced
    with MIN (:meth:`agree`): ``finite`` holds only where it holds on every rank, the negated
    stop fields agree on the largest.

    Not a value but the step's one host read, made lazily and kept: :meth:`read` copies
    ``flags`` to the host the first time it is called and answers from that copy after, so
    whichever of the backend and the engine reads first pays and the other reads free.
    Lazily, not in :meth:`agree`: DeepSpeed's backend queues its backward on :attr:`apply`
    (device side) before it reads, and a read at construction would make the host wait for
    the all-reduce before that backward is queued.
    """

    def __init__(self, flags: Tensor) -> None:
        self.flags = flags
        self._host: tuple[bool, StopRequest] | None = None  # read() fills it, once

    @classmethod
    def agree(cls, finite: Tensor, stop: StopRequest,
              group: dist.ProcessGroup | None) -> Verdict:
        """One all-reduce on ``group``, no host read: ``finite`` is a 0-d bool tensor on the
        device; ``torch.full`` writes the stop fields there (a tensor made from host values
        would be a blocking copy)."""
        device = finite.device
        flags = torch.stack([finite.to(torch.int32),
                             torch.full((), -int(stop.reason), dtype=torch.int32, device=device),
                             torch.full((), -stop.signum, dtype=torch.int32, device=device)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
        return cls(flags)

    @property
    def apply(self) -> Tensor:
        """0-d bool on the device: the step may update (every loss and gradient finite)."""
        return self.flags[0] > 0

    def read(self) -> tuple[bool, StopRequest]:
        """``(finite, stop)`` on the host: the step's one host read, made on the first call."""
        if self._host is None:
            finite, reason, signum = self.flags.tolist()
            self._host = bool(finite), StopRequest(StopReason(-reason), -signum)
        return self._host

    @property
    def applies(self) -> bool:
        """:attr:`apply` on the host (:meth:`read`)."""
        return self.read()[0]


@dataclass(frozen=True)
class Update:
    """Whether the backbone's update of this step was applied; the head follows it."""

    applied: bool
    overflow: bool  # not applied for the fp16 loss scaler alone: a normal skip, not a bad step
    grad_norm: Tensor | float  # the backbone's gradient norm (before clipping), on the device


@runtime_checkable
class BackboneBackend(Protocol):
    """The data-parallel engine of the backbone, built on every rank of ``env.group``.

    Constructed as ``Backend(cfg, module, backbone, optimizer, env)``: ``module`` is what it
    runs (the backbone, or its ``torch.compile`` sharing its parameters), ``backbone`` the
    bare module whose parameters it trains with the torch ``optimizer``.
    """

    model: nn.Module  # the wrapped module the forward is called on
    input_dtype: torch.dtype  # the dtype the images must have (DeepSpeed: its parameters')
    # Whether the backbone's parameters may be held channels_last (the input is either way).
    channels_last_parameters: bool

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

    def last_backward(self, surrogate: Tensor) -> Tensor | None:
        """Backward of the last micro-batch; returns the backbone's own finite flag (a 0-d
        bool tensor on the device, which joins the :class:`Verdict`), or None where the
        backend can only act on the verdict in its backward (DeepSpeed: it runs the
        backward in :meth:`update`)."""
        ...

    def update(self, verdict: Verdict, step: int) -> Update:
        """The backbone's update (gradients clipped to ``train.clip_grad_norm``) when
        ``verdict.apply``, none otherwise; the gradients are cleared either way. ``step``
        (0-based) names the step in an error."""
        ...

    def optimizer_state(self) -> dict[str, Tensor]:
        """The backbone optimizer's state in full (un-partitioned) form, replicated, under
        names this backend chooses (``trainer.engine.state.EngineState.backbone_optimizer``);
        collective."""
        ...

    def load_optimizer_state(self, state: Mapping[str, Tensor]) -> None:
        """Load what :meth:`optimizer_state` named; collective."""
        ...

    def master_weights(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The fp32 master copy of the backbone's parameters held in ``state`` (what
        :meth:`optimizer_state` returned), by parameter name; empty where the parameters are
        their own master."""
        ...


def torch_optimizer_state(backbone: nn.Module, optimizer: torch.optim.Optimizer
                          ) -> dict[str, Tensor]:
    """A plain torch optimizer's per-parameter state as ``opt.<param>.<key>``."""
    return {f"opt.{name}.{key}": torch.as_tensor(value)
            for name, p in backbone.named_parameters()
            for key, value in optimizer.state.get(p, {}).items()}


def load_torch_optimizer_state(backbone: nn.Module, optimizer: torch.optim.Optimizer,
                               state: Mapping[str, Tensor]) -> None:
    """Put :func:`torch_optimizer_state`'s entries back, on each parameter's device."""
    for name, p in backbone.named_parameters():
        prefix = f"opt.{name}."
        mine = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if mine:
            optimizer.state[p] = {k: v.to(p.device) for k, v in mine.items()}
