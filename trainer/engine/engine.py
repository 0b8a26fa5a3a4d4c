"""One optimisation step: data-parallel backbone (DDP or DeepSpeed) + model-parallel head.

The sharded head is deliberately **outside** DDP/DeepSpeed: its rows are never averaged
(docs/design.md, invariant 2) and it has its own row-sampling optimizer
(``partial_fc.optim.SampledSGD/SampledAdamW``). A step splits the backward in two:

1. ``e = emb.detach().float()``; ``loss = head(e, labels)`` (in a bf16 run under bf16
   autocast: bf16 matmul operands, fp32 softmax); ``loss.backward()`` gives the head rows
   their exact gradient and ``e.grad = dL_global/de_local`` (the head's contract, in fp32,
   untouched by any engine loss scaling);
2. the backbone backward runs on the surrogate ``sum(emb * P * e.grad)``: its parameter
   gradient on this rank is ``P * dL_global/dtheta|local``; DDP/DeepSpeed average over the
   P ranks, leaving ``sum_r dL_global/dtheta|r`` — the single-process gradient of the
   global-batch loss.

Gradient accumulation over ``k`` micro-batches averages the k global-batch gradients; it
is exact only when each forward is independent of the others (``trainer.config`` refuses
class sampling, dynamic AdaCos and SphereFace's per-forward lambda with ``k > 1``).
BatchNorm statistics are per rank and per micro-batch, as in any data-parallel run.

What only DeepSpeed needs (its config and import, ``deepspeed.initialize``, its backward +
step and the overflow checks that decide whether it applied the update) is in
``trainer.engine.deepspeed_backend``; this module keeps what both engines share.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from partial_fc.backbones import normalize_images
from partial_fc.optim import SampledAdamW, SampledSGD
from partial_fc.readout import DeviceScalars
from partial_fc.rows import SampledRows
from trainer.config import Config, OptimConfig, ScheduleConfig
from trainer.engine.deepspeed_backend import DeepSpeedBackbone, loss_scale_overflow


def lr_factor(schedule: ScheduleConfig, warmup_steps: int, total_steps: int) -> Callable:
    """``step -> lr multiplier``: linear warm-up to 1, then ``(1 - t)^power`` or cosine to 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule.type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * t))
        return (1.0 - t) ** schedule.power

    return factor


def _optimizer_kwargs(optim: OptimConfig) -> dict:
    """The hyper-parameters both optimizers share, besides ``lr``."""
    if optim.name == "sgd":
        return {"momentum": optim.momentum, "weight_decay": optim.weight_decay}
    return {"betas": tuple(optim.betas), "eps": optim.eps, "weight_decay": optim.weight_decay}


def make_optimizer(optim: OptimConfig, params) -> torch.optim.Optimizer:
    """The backbone's torch optimizer."""
    cls = torch.optim.SGD if optim.name == "sgd" else torch.optim.AdamW
    return cls(params, lr=optim.lr, **_optimizer_kwargs(optim))


def make_head_optimizer(optim: OptimConfig, weight: nn.Parameter,
                        max_update_bytes: int) -> torch.optim.Optimizer:
    """The optimizer of the head's ``weight``, row-sampling (unsampled rows get no momentum,
    no decay): it steps from the head's ``pop_sampled_rows()``."""
    cls = SampledSGD if optim.name == "sgd" else SampledAdamW
    return cls(weight, optim.lr, **_optimizer_kwargs(optim), max_update_bytes=max_update_bytes)


class Engine:
    """Backbone wrapper + both optimizers + the LR schedule; ``step`` does one update.

    Build on every rank after the default process group is up. ``head`` is a
    ``partial_fc.PartialFC`` on the same group; ``backbone`` is the bare module (kept as
    ``self.backbone`` for evaluation and checkpoints).
    """

    def __init__(
        self,
        cfg: Config,
        backbone: nn.Module,
        head: nn.Module,
        device: torch.device,
        total_steps: int,
        warmup_steps: int,
    ):
        self.cfg, self.device = cfg, device
        self.world_size = dist.get_world_size()
        self.memory_format = self._cuda_settings()
        self.backbone = backbone.to(device, memory_format=self.memory_format)
        self.head = head.to(device)
        self.head_optimizer = make_head_optimizer(cfg.optim, self.head.weight,
                                                  cfg.head.max_update_mib << 20)
        self.optimizer = make_optimizer(cfg.optim, self.backbone.parameters())
        self.lr_factor = lr_factor(cfg.schedule, warmup_steps, total_steps)
        trained = self._compiled() if cfg.engine.compile else self.backbone
        self._ds_backbone: DeepSpeedBackbone | None = None
        if cfg.engine.type == "deepspeed":
            self._ds_backbone = DeepSpeedBackbone(cfg, trained, self.backbone, self.optimizer,
                                                  device, self.world_size)
            self.model = self._ds_backbone.model
            self.input_dtype = self._ds_backbone.input_dtype
        else:
            ids = [device.index] if device.type == "cuda" else None
            self.model = DistributedDataParallel(trained, device_ids=ids)
            self.input_dtype = torch.float32
        self.set_lr(0)

    @property
    def deepspeed(self) -> bool:
        """Whether DeepSpeed runs the backbone (``engine.type``), else DDP."""
        return self._ds_backbone is not None

    def _cuda_settings(self) -> torch.memory_format:
        """cuDNN autotuning and the backbone's memory format: channels_last on CUDA (NHWC
        is what tensor-core convolutions read; NCHW costs a transpose per layer), the default
        on CPU, where neither setting is touched (``engine.channels_last``,
        ``engine.cudnn_benchmark``). Not on CPU also because torch 2.13's CPU backward of a
        1x1 stride-2 convolution (iResNet's downsample) in channels_last corrupts the heap
        (measured: ``malloc(): invalid next size``, then a segfault)."""
        if self.device.type != "cuda":
            return torch.contiguous_format
        torch.backends.cudnn.benchmark = self.cfg.engine.cudnn_benchmark
        return torch.channels_last if self.cfg.engine.channels_last else torch.contiguous_format

    def _compiled(self) -> nn.Module:
        """``torch.compile`` of the backbone, sharing its parameters, for DDP/DeepSpeed to run
        (``engine.compile``). Inside DDP, as PyTorch's docs advise: dynamo still splits the
        graph at DDP's buckets (DDPOptimizer), so the all-reduce overlaps the backward.
        DeepSpeed's ``engine.compile()`` would compile ``self.backbone`` in place, evaluation
        included; this keeps it eager, its state_dict keys free of ``_orig_mod.``. Off CUDA,
        inductor's layout optimisation is off: it would pick channels_last for the
        convolutions, whose CPU backward crashes as :meth:`_memory_format` says (seen again
        under inductor, a segfault in the 2-rank compile test on an AMX Xeon, torch 2.13)."""
        if self.device.type != "cuda":
            return torch.compile(self.backbone, options={"layout_optimization": False})
        return torch.compile(self.backbone)

    def set_lr(self, step: int) -> float:
        """Set both optimizers' learning rate for optimisation step ``step`` (0-based)."""
        lr = self.cfg.optim.lr * self.lr_factor(step)
        for opt in (self.optimizer, self.head_optimizer):
            for group in opt.param_groups:
                group["lr"] = lr
        return lr

    def _no_sync(self, boundary: bool):
        if self.deepspeed or boundary:
            return contextlib.nullcontext()
        return self.model.no_sync()

    def _head_operands(self):
        """A bf16 run gives the head bf16 matmul operands (fp32 accumulation; its softmax,
        loss and statistics stay fp32: ``PartialFC`` under autocast), as insightface's
        autocast head does; fp32 operands would cost the Triton kernels IEEE fp32 dots, about
        15x the bf16 time on an H100. An fp16 run keeps fp32 operands: the head's backward is
        not loss-scaled, and fp16 flushes ``dL/dcos`` entries below 2^-24 to zero (``s p / N``
        of a non-target at a million classes is about that)."""
        if self.cfg.engine.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _autocast(self):
        if not self.deepspeed and self.cfg.engine.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(
        self,
        step: int,
        micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        angles: bool = False,
        stop_request: int = 0,
    ) -> DeviceScalars:
        """One optimisation step over ``grad_accum`` micro-batches of uint8 images + labels.

        Returns ``{"loss", "lr", "grad_norm", "skipped", "overflow", "stop_request"}`` (loss =
        mean over micro-batches of the global-batch loss, identical on all ranks;
        ``stop_request`` the largest ``stop_request`` any rank passed, e.g. the number of a
        signal asking the run to stop, agreed in the same all-reduce as the step's flags so
        that every rank stops after the same step at no extra host read); with
        ``angles=True`` also ``"angles"`` from ``PartialFC.angle_sample`` on the last
        micro-batch (collective). ``loss`` and ``grad_norm`` stay on the device until one of
        them is read (``partial_fc.readout.DeviceScalars``): the trainer reads them every
        ``log.every`` steps, so a step does not wait for its own numbers.

        ``skipped`` is True, on every rank alike, when the step was dropped because the loss,
        an embedding gradient, the head gradient or the backbone gradient norm was not finite
        (:meth:`_agree`, DeepSpeed's own overflow check: ``trainer.engine.deepspeed_backend``): then
        neither the backbone nor the head is updated, both optimizers' states and every buffer
        (BatchNorm statistics, the AdaCos scale) are as before the step, and the gradients
        are cleared. ``overflow`` is True when the skip was DeepSpeed's fp16 loss scaler's
        alone (``trainer.engine.deepspeed_backend.loss_scale_overflow``): the same skip of both
        optimizers, but not a sign of divergence. A label out of range raises the head's
        ``ValueError`` on every rank, before any update.

        Host reads (each makes the CPU wait for the device; tests/test_engine_syncs.py holds
        the budget): DDP at ``sample_rate == 1``, one: the agreed flags (finite; labels in
        range, the head's deferred check) of one all-reduce, read after the backbone's
        backward to decide whether the optimizers step (a host call). The head gets the
        batch sizes from ``train.batch_size`` (the loader's batches are equal), not from an
        exchange. ``r < 1`` adds the sampler's (its size depends on the labels); the head
        optimizer reads none after one forward. DeepSpeed reads its overflow flag in
        ``step()``; the flags here NaN the surrogate on the device and are read after it.
        """
        lr = self.set_lr(step)
        k = len(micro_batches)
        buffers = self._buffers()
        sizes = [self.cfg.train.batch_size] * self.world_size
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        flags, dropped = None, False
        for i, (images, labels) in enumerate(micro_batches):
            boundary = i == k - 1
            x = normalize_images(images.to(self.device, non_blocking=True))
            x = x.to(dtype=self.input_dtype, memory_format=self.memory_format)
            y = labels.to(self.device, non_blocking=True)
            with self._no_sync(boundary):
                with self._autocast():
                    emb = self.model(x)
                e = emb.detach().float().requires_grad_()
                with self._head_operands():
                    loss = self.head(e, y, sizes=sizes, defer_label_check=True)
                (loss / k).backward()
                finite &= torch.isfinite(loss) & torch.isfinite(e.grad).all()
                loss_sum += loss.detach()  # fp64: the sum Python floats gave
                if boundary:  # the step's one pop: a skipped step drops the rows
                    rows = self.head.pop_sampled_rows()
                    grad = self.head.weight.grad
                    if grad is not None:
                        finite &= torch.isfinite(grad.sum())
                surrogate = (emb.float() * (e.grad * self.world_size)).sum()
                if angles and boundary:
                    sample = self.head.angle_sample(e.detach(), y)
                if self.deepspeed:
                    if boundary:  # a bad step's NaN makes DeepSpeed drop it (no host read)
                        flags = self._agree(finite, rows, stop_request)
                        surrogate = surrogate * torch.where(flags[:2].min() > 0, 1.0, math.nan)
                    dropped = self._ds_backbone.backward(surrogate, boundary, step)
                else:
                    surrogate.backward()
        if self.deepspeed:
            grad_norm = self._ds_backbone.grad_norm()
        else:
            grad_norm = self._clip()
            # DDP's gradients are all-reduced, so every rank computes the same norm.
            flags = self._agree(finite & torch.isfinite(grad_norm), rows, stop_request)
        all_finite, labels_ok, minus_stop = flags.tolist()  # the step's one host read
        if not labels_ok:
            rows.raise_label_error()
        overflow = loss_scale_overflow(dropped, not all_finite, self.cfg.engine.precision)
        skip = not all_finite or dropped
        if not self.deepspeed:
            if not skip:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if skip:  # the rows this step used are not updated
            self._restore_buffers(buffers)
        else:
            self.head_optimizer.step(rows)
        self.head_optimizer.zero_grad(set_to_none=True)
        out = {"loss": loss_sum / k, "lr": lr, "grad_norm": grad_norm, "skipped": skip,
               "overflow": overflow, "stop_request": -minus_stop}
        if angles:
            out["angles"] = sample
        return DeviceScalars(out)

    def _agree(self, finite: torch.Tensor, rows: SampledRows, stop_request: int) -> torch.Tensor:
        """``[finite, labels in range, -max stop_request]`` as int32 on the device: the two
        0/1 flags are 1 only where they hold on every rank; one all-reduce (MIN), no host
        read. The label flag is ``rows``' deferred check of this step's forwards (the same
        on all ranks: gathered labels). ``stop_request`` enters negated, so MIN agrees on
        the largest; ``torch.full`` writes it on the device (a tensor made from a host value
        would be a blocking copy)."""
        request = torch.full((), -stop_request, dtype=torch.int32, device=self.device)
        flags = torch.stack([finite.to(torch.int32), rows.labels_ok().to(torch.int32),
                             request])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        return flags

    def _buffers(self) -> dict[str, torch.Tensor]:
        """Copies of the backbone's and the head's buffers (BatchNorm statistics, the
        AdaCos scale, the head's step): a forward updates them, a skipped step puts them back."""
        modules = {"backbone": self.backbone, "head": self.head}
        return {
            f"{name}.{key}": value.detach().clone()
            for name, module in modules.items()
            for key, value in module.named_buffers()
        }

    def _restore_buffers(self, saved: dict[str, torch.Tensor]) -> None:
        """Put back :meth:`_buffers`' copies; the head re-reads its ``step`` (the host copy
        it keeps to seed the sampler would otherwise be one ahead)."""
        modules = {"backbone": self.backbone, "head": self.head}
        with torch.no_grad():
            for name, module in modules.items():
                for key, value in module.named_buffers():
                    value.copy_(saved[f"{name}.{key}"])
        self.head.resync_step()

    def eval_context(self):
        """Autocast for evaluating ``self.backbone`` when DeepSpeed holds it in bf16/fp16."""
        if self.input_dtype != torch.float32:
            return torch.autocast(self.device.type, dtype=self.input_dtype)
        return contextlib.nullcontext()

    def _clip(self) -> torch.Tensor:
        """The backbone's gradient norm, a 0-d fp32 tensor (no host read), after clipping the
        gradients to ``train.clip_grad_norm`` when it is set."""
        params = [p for p in self.backbone.parameters() if p.grad is not None]
        clip = self.cfg.train.clip_grad_norm
        if clip is None:
            return torch.stack([p.grad.detach().float().norm() for p in params]).norm()
        return torch.nn.utils.clip_grad_norm_(params, clip)
