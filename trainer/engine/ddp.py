"""The backbone under torch's DistributedDataParallel (``engine.type=ddp``).

DDP keeps full fp32 parameters and a plain torch optimizer on every rank and all-reduces
(averages) the gradients during the last micro-batch's backward; a bf16 run autocasts the
forward. It has no overflow check of its own: the finiteness of the gradient norm joins the step's
verdict (``trainer.engine.backend.Verdict``), and the optimizer steps only on a verdict for it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel

from trainer.config import Config
from trainer.dist import DistEnv
from trainer.engine.backend import (
    Update,
    Verdict,
    load_torch_optimizer_state,
    torch_optimizer_state,
)


def buffer_sync(forward: bool) -> dict[str, bool]:
    """DDP's keyword for copying rank 0's buffers (BatchNorm running statistics) to every
    rank before each forward (``engine.broadcast_buffers``), by the name this torch's
    ``DistributedDataParallel`` accepts: ``forward_sync_buffers`` where its signature has it
    (torch 2.13 on, which deprecates ``broadcast_buffers`` with a FutureWarning), else
    ``broadcast_buffers`` (torch 2.11 and 2.12).

    The two differ at construction only when ``forward`` is false: ``broadcast_buffers=False``
    also leaves the buffers out of DDP's initial broadcast from rank 0, while
    ``forward_sync_buffers=False`` still broadcasts them there (the parameters are broadcast
    either way). For this trainer that broadcast copies equal values: every rank builds the
    backbone from the same seed and the same ``backbone.weights`` (``trainer.build.build``),
    so its buffers are equal on every rank (BatchNorm's start at the constants 0, 1 and 0:
    mean, var, batches tracked), and a resumed run loads its checkpoint (the rank mean of
    the buffers, ``trainer.checkpoint.state.average_buffers``) after the engine is built.
    Past construction the names mean the same: rank 0's buffers before every forward, or
    (false) each rank's own."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in params
            else "broadcast_buffers": forward}


def wraps(cfg: Config, env: DistEnv) -> bool:
    """Whether the backbone runs inside ``DistributedDataParallel``: on several ranks, and on
    one only with ``engine.one_rank_ddp``. On one rank DDP averages each gradient over one
    rank and broadcasts parameters and buffers to themselves, so the unwrapped module trains
    the same steps; what it saves is DDP's per-parameter autograd hooks and the copies into
    and out of its buckets (the H200's one-rank iresnet50 step spent 3.7 + 3.9 ms over the
    backbone alone's forward and backward, put down to them in docs/benchmarks.md).
    ``engine.grad_compression=fp16`` has no traffic to halve there: unwrapped, the gradients
    are not rounded to fp16 on the way."""
    return env.world_size > 1 or cfg.engine.one_rank_ddp


class DDPBackend:
    """:class:`trainer.engine.backend.BackboneBackend` over ``DistributedDataParallel`` on
    ``env.group``, or over the bare module on one rank (:func:`wraps`). Either way
    ``backbone``'s own parameter names are what a checkpoint holds, so the two read each
    other's checkpoints."""

    channels_last_parameters = True  # DDP's buckets follow each gradient's strides

    def __init__(self, cfg: Config, module: nn.Module, backbone: nn.Module,
                 optimizer: torch.optim.Optimizer, env: DistEnv):
        self.model, self.wrapped = module, wraps(cfg, env)
        if self.wrapped:
            ids = [env.device.index] if env.device.type == "cuda" else None
            self.model = DistributedDataParallel(module, device_ids=ids, process_group=env.group,
                                                 **buffer_sync(cfg.engine.broadcast_buffers))
            if cfg.engine.grad_compression == "fp16":
                self.model.register_comm_hook(env.group, fp16_compress_hook)
        self.input_dtype = torch.float32
        self.backbone, self.optimizer = backbone, optimizer
        self.device_type = env.device.type
        self.precision, self.clip = cfg.engine.precision, cfg.train.clip_grad_norm
        self.foreach = cfg.engine.fused_updates and self.device_type == "cuda"
        self._grad_norm: Tensor | None = None  # last_backward's, for update

    def micro_batch(self, boundary: bool):
        """No gradient all-reduce before the last micro-batch (``no_sync``); unwrapped,
        nothing to hold back."""
        if boundary or not self.wrapped:
            return contextlib.nullcontext()
        return self.model.no_sync()

    def autocast(self):
        if self.precision == "bf16":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def backward(self, surrogate: Tensor) -> None:
        surrogate.backward()

    def last_backward(self, surrogate: Tensor) -> Tensor:
        surrogate.backward()
        self._grad_norm = self._clip()
        # DDP's gradients are all-reduced, so every rank computes the same norm.
        return torch.isfinite(self._grad_norm)

    def update(self, verdict: Verdict, step: int) -> Update:
        applied = verdict.applies
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return Update(applied=applied, overflow=False, grad_norm=self._grad_norm)

    def optimizer_state(self) -> dict[str, Tensor]:
        return torch_optimizer_state(self.backbone, self.optimizer)

    def load_optimizer_state(self, state: Mapping[str, Tensor]) -> None:
        load_torch_optimizer_state(self.backbone, self.optimizer, state)

    def master_weights(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {}  # fp32 parameters: their own master

    def _clip(self) -> Tensor:
        """The backbone's gradient norm, a 0-d fp32 tensor (no host read), after clipping the
        gradients to ``train.clip_grad_norm`` when it is set. ``foreach`` (CUDA with
        ``engine.fused_updates``): the per-tensor norms and the scaling as multi-tensor
        kernels, a few launches instead of two per parameter; torch offers them on CUDA only,
        and computes the same sums of squares (tests/trainer/test_backends.py)."""
        params = [p for p in self.backbone.parameters() if p.grad is not None]
        if self.clip is None:
            return torch.nn.utils.get_total_norm([p.grad for p in params],
                                                 foreach=self.foreach).float()
        return torch.nn.utils.clip_grad_norm_(params, self.clip, foreach=self.foreach)
