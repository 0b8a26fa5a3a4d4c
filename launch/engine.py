"""One optimisation step: data-parallel backbone (DDP or DeepSpeed) + model-parallel head.

The sharded head is deliberately **outside** DDP/DeepSpeed: its rows are never averaged
(docs/design.md, invariant 2) and it has its own row-sampling optimizer
(``partial_fc.optim.SampledSGD/SampledAdamW``). A step splits the backward in two:

1. ``e = emb.detach().float()``; ``loss = head(e, labels)``; ``loss.backward()`` gives the
   head rows their exact gradient and ``e.grad = dL_global/de_local`` (the head's contract,
   in fp32, untouched by any engine loss scaling);
2. the backbone backward runs on the surrogate ``sum(emb * P * e.grad)``: its parameter
   gradient on this rank is ``P * dL_global/dtheta|local``; DDP/DeepSpeed average over the
   P ranks, leaving ``sum_r dL_global/dtheta|r`` — the single-process gradient of the
   global-batch loss.

Gradient accumulation over ``k`` micro-batches averages the k global-batch gradients; it
is exact only when each forward is independent of the others (``launch.config`` refuses
class sampling, dynamic AdaCos and SphereFace's per-forward lambda with ``k > 1``).
BatchNorm statistics are per rank and per micro-batch, as in any data-parallel run.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch.config import Config, OptimConfig, ScheduleConfig
from partial_fc.backbones import normalize_images
from partial_fc.optim import SampledAdamW, SampledSGD
from partial_fc.readout import DeviceScalars


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


def make_head_optimizer(optim: OptimConfig, head: nn.Module,
                        max_update_bytes: int) -> torch.optim.Optimizer:
    """The head's row-sampling optimizer (unsampled rows get no momentum, no decay)."""
    cls = SampledSGD if optim.name == "sgd" else SampledAdamW
    return cls(head, optim.lr, **_optimizer_kwargs(optim), max_update_bytes=max_update_bytes)


def deepspeed_config(cfg: Config, world_size: int) -> dict:
    """The DeepSpeed JSON for the backbone. The optimizer is passed as a torch object."""
    micro, accum = cfg.train.batch_size, cfg.train.grad_accum
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world_size,
        "zero_optimization": {"stage": cfg.engine.zero_stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": cfg.train.clip_grad_norm or 0.0,
        # check_grad_overflow: drop a step with non-finite gradients (Engine.step's guard).
        "bf16": {"enabled": cfg.engine.precision == "bf16", "check_grad_overflow": True},
        "fp16": {"enabled": cfg.engine.precision == "fp16"},
        "steps_per_print": 2**31 - 1,
    }


def import_deepspeed(device: torch.device):
    """DeepSpeed, with its accelerator on ``device``'s type (cpu or cuda).

    DeepSpeed picks one accelerator per process, CUDA whenever a GPU is visible: a
    ``device=cpu`` run (the gloo tests) on a GPU machine would get its backbone moved to the
    GPU while the head and the data stay on the CPU. ``DS_ACCELERATOR`` before the first
    import is DeepSpeed's documented switch; ``set_accelerator`` corrects a process that
    imported it earlier for another device.
    """
    want = "cpu" if device.type == "cpu" else "cuda"
    os.environ["DS_ACCELERATOR"] = want
    import deepspeed
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != want:
        if want == "cpu":
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as Accelerator
        else:
            from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as Accelerator
        set_accelerator(Accelerator())
    return deepspeed


class LossScaleFloor(RuntimeError):
    """fp16: the gradients overflow even at DeepSpeed's smallest loss scale (all ranks alike)."""


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
        self.head_optimizer = make_head_optimizer(cfg.optim, head, cfg.head.max_update_mib << 20)
        self.optimizer = make_optimizer(cfg.optim, self.backbone.parameters())
        self.lr_factor = lr_factor(cfg.schedule, warmup_steps, total_steps)
        self.deepspeed = cfg.engine.type == "deepspeed"
        self.input_dtype = torch.float32
        trained = self._compiled() if cfg.engine.compile else self.backbone
        if self.deepspeed:
            self.model = self._init_deepspeed(trained)
            self.input_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
                cfg.engine.precision, torch.float32
            )
        else:
            ids = [device.index] if device.type == "cuda" else None
            self.model = DistributedDataParallel(trained, device_ids=ids)
        self.set_lr(0)

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
        included; this keeps it eager, its state_dict keys free of ``_orig_mod.``."""
        return torch.compile(self.backbone)

    def _init_deepspeed(self, module: nn.Module) -> nn.Module:
        deepspeed = import_deepspeed(self.device)
        from deepspeed import ops as deepspeed_ops

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        # DeepSpeed 0.19's ZeRO calls torch's deprecated all_gather_into_tensor every step;
        # the FutureWarning is theirs to fix and would flood the log on every rank.
        warnings.filterwarnings(
            "ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning
        )
        if self.device.type == "cpu" and not self.cfg.engine.cpu_shm_comm:
            # DeepSpeed JIT-builds a shared-memory all-reduce for CPU on first use (30-50 s);
            # without it its collectives go through the gloo group (config: engine.cpu_shm_comm).
            deepspeed_ops.__compatible_ops__["deepspeed_shm_comm"] = False
        model, _, _, _ = deepspeed.initialize(
            model=module,
            optimizer=self.optimizer,
            config=deepspeed_config(self.cfg, self.world_size),
            dist_init_required=False,
        )
        return model

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
        (:meth:`_agree`, DeepSpeed's own overflow check): then neither the backbone nor
        the head is updated, both optimizers' states and every buffer (BatchNorm statistics,
        the AdaCos scale) are as before the step, and the gradients are cleared.
        ``overflow`` is True when the skip was DeepSpeed's fp16 loss scaler's alone
        (:meth:`_loss_scale_overflow`): the same skip of both optimizers, but not a sign of
        divergence. A label out of range raises the head's ``ValueError`` on every rank,
        before any update.

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
                loss = self.head(e, y, sizes=sizes, defer_label_check=True)
                (loss / k).backward()
                finite &= torch.isfinite(loss) & torch.isfinite(e.grad).all()
                loss_sum += loss.detach()  # fp64: the sum Python floats gave
                if boundary:
                    grad = self.head.weight.grad
                    if grad is not None:
                        finite &= torch.isfinite(grad.sum())
                surrogate = (emb.float() * (e.grad * self.world_size)).sum()
                if angles and boundary:
                    sample = self.head.angle_sample(e.detach(), y)
                if self.deepspeed:
                    if boundary:  # a bad step's NaN makes DeepSpeed drop it (no host read)
                        flags = self._agree(finite, stop_request)
                        surrogate = surrogate * torch.where(flags[:2].min() > 0, 1.0, math.nan)
                    dropped = self._deepspeed_backward(surrogate, boundary, step)
                else:
                    surrogate.backward()
        if self.deepspeed:
            norm = self.model.get_global_grad_norm()
            grad_norm = norm if norm is not None else math.nan
        else:
            grad_norm = self._clip()
            # DDP's gradients are all-reduced, so every rank computes the same norm.
            flags = self._agree(finite & torch.isfinite(grad_norm), stop_request)
        all_finite, labels_ok, minus_stop = flags.tolist()  # the step's one host read
        if not labels_ok:
            self.head.raise_label_error()
        overflow = self._loss_scale_overflow(dropped, not all_finite)
        skip = not all_finite or dropped
        if not self.deepspeed:
            if not skip:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if skip:
            self.head.pop_sampled_rows()  # the rows this step used are not updated
            self._restore_buffers(buffers)
        else:
            self.head_optimizer.step()
        self.head_optimizer.zero_grad(set_to_none=True)
        out = {"loss": loss_sum / k, "lr": lr, "grad_norm": grad_norm, "skipped": skip,
               "overflow": overflow, "stop_request": -minus_stop}
        if angles:
            out["angles"] = sample
        return DeviceScalars(out)

    def _loss_scale_overflow(self, dropped: bool, bad: bool) -> bool:
        """Whether DeepSpeed dropped this step for its fp16 loss scaler only.

        ``dropped``: DeepSpeed did not apply the update (``was_step_applied``); ``bad``: this
        engine's own all-reduced check found a non-finite loss or embedding/head gradient.
        In fp16 a drop with finite loss and head gradients means the *scaled* backbone
        gradients overflowed: the scaler halves its scale and goes on. That is the normal
        start of an fp16 run (the scale begins at 2^16), counted as ``skipped_steps`` and
        not towards ``train.max_bad_steps``; a backbone that really diverges drives the
        scale to its minimum, where DeepSpeed stops the run itself. In bf16/fp32 there is
        no scale, so a drop is a non-finite gradient (a bad step).
        """
        return dropped and not bad and self.cfg.engine.precision == "fp16"

    def _agree(self, finite: torch.Tensor, stop_request: int) -> torch.Tensor:
        """``[finite, labels in range, -max stop_request]`` as int32 on the device: the two
        0/1 flags are 1 only where they hold on every rank; one all-reduce (MIN), no host
        read. The label flag is the head's deferred check of this step's forwards (the same
        on all ranks: gathered labels). ``stop_request`` enters negated, so MIN agrees on
        the largest; ``torch.full`` writes it on the device (a tensor made from a host value
        would be a blocking copy)."""
        request = torch.full((), -stop_request, dtype=torch.int32, device=self.device)
        flags = torch.stack([finite.to(torch.int32), self.head.pop_label_check().to(torch.int32),
                             request])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        return flags

    def _deepspeed_backward(self, surrogate: torch.Tensor, boundary: bool, step: int) -> bool:
        """DeepSpeed's backward + step for one micro-batch; True when the update was dropped.

        DeepSpeed has no public "skip this step" call, but its ZeRO, bf16 and fp16 optimizers
        drop a step whose reduced gradients are not finite (``check_grad_overflow``; the
        gradient reduction makes that decision the same on every rank) and say so through
        ``was_step_applied()``. A step this engine's flags call bad arrives with a NaN
        surrogate (multiplied in on the device by the caller), so DeepSpeed drops it by that
        same path. Without ZeRO in fp32 DeepSpeed
        steps the plain torch optimizer with no such check: there the (all-reduced, so
        identical) gradients are checked here, and a dropped step is stepped on zeroed
        gradients and then undone (parameters and optimizer state put back).
        """
        self.model.backward(surrogate, scale_wrt_gas=False)
        if not boundary:
            self.model.step()
            return False
        if self._deepspeed_checks_overflow():
            self._scaled_step(step)
            return not self.model.was_step_applied()
        grads = [p.grad for p in self.backbone.parameters() if p.grad is not None]
        if bool(torch.isfinite(torch.stack([g.float().norm() for g in grads]).sum())):
            self.model.step()
            return False
        params = [p.detach().clone() for p in self.backbone.parameters()]
        state = copy.deepcopy(self.optimizer.state_dict())
        for g in grads:
            g.zero_()
        self.model.step()  # keeps DeepSpeed's step counters in line
        self.optimizer.load_state_dict(state)
        with torch.no_grad():
            for p, saved in zip(self.backbone.parameters(), params, strict=True):
                p.copy_(saved)
        return True

    def _scaled_step(self, step: int) -> None:
        """DeepSpeed's step, its fp16 loss scaler's dead end as :class:`LossScaleFloor`.

        The scaler halves its scale on each overflow and, once at its minimum (1), raises a
        bare ``Exception`` (deepspeed/runtime/fp16/loss_scaler.py; the message is the only
        way to tell it from a bug). Every rank reaches it on the same step.
        """
        try:
            self.model.step()
        except Exception as err:
            if "loss scale already at minimum" not in str(err):
                raise
            raise LossScaleFloor(
                f"step {step + 1}: fp16 gradients overflow even at DeepSpeed's minimum loss "
                "scale: the backbone diverges; lower optim.lr, or train with "
                "engine.precision=bf16"
            ) from None

    def _deepspeed_checks_overflow(self) -> bool:
        """Whether DeepSpeed's optimizer checks the gradients for inf/NaN before a step."""
        model = self.model
        return model.zero_optimization() or model.bfloat16_enabled() or model.fp16_enabled()

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
        modules = {"backbone": self.backbone, "head": self.head}
        with torch.no_grad():
            for name, module in modules.items():
                for key, value in module.named_buffers():
                    value.copy_(saved[f"{name}.{key}"])

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
