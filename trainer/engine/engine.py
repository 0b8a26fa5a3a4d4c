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

What differs between the backbone's engines (wrapping, precision, backward, clipping, the
step and how a dropped one shows, the optimizer state's form) is behind
``trainer.engine.backend.BackboneBackend`` (``ddp.py``, ``deepspeed_backend.py``); this
module keeps the head, the step's order and what every engine shares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from partial_fc import metric_names as names
from partial_fc.backbones import normalize_images
from partial_fc.distill import cosine_summary, distill_loss
from partial_fc.readout import DeviceScalars
from partial_fc.rows import SampledRows
from trainer import seams
from trainer.config import Config
from trainer.dist import DistEnv
from trainer.engine.backend import BackboneBackend, Verdict
from trainer.engine.ddp import DDPBackend
from trainer.engine.deepspeed_backend import DeepSpeedBackend
from trainer.engine.optimizers import lr_factor, make_head_optimizer, make_optimizer
from trainer.engine.prefetch import Prefetch
from trainer.engine.snapshot import Snapshot
from trainer.engine.state import EngineState, Rows
from trainer.engine.step_statistics import moves_statistics, step_embeddings
from trainer.stopping import NO_STOP, StopRequest, StopRequests


class Teacher(Protocol):
    """What a step needs of distillation (``trainer.distill.Distillation`` is one): the loss
    and its weight, whether the embeddings are stored (``offline``), and the teacher's
    ``[n, D_t]`` embeddings of a micro-batch. Declared here rather than imported, since
    ``trainer.distill`` reads checkpoints, whose package imports this one."""

    loss: str
    weight: float
    offline: object | None

    def teacher(self, x: Tensor, stored: Tensor | None) -> Tensor: ...

BACKENDS: dict[str, type[BackboneBackend]] = {
    "ddp": DDPBackend,
    "deepspeed": DeepSpeedBackend,
}
"""``engine.type`` -> the backbone's engine (``trainer.engine.backend``)."""


@dataclass(frozen=True)
class StepResult:
    """What one :meth:`Engine.step` did, the same on every rank.

    ``loss`` (mean over the micro-batches of the global-batch loss) and ``grad_norm`` (the
    backbone's, before clipping; NaN where DeepSpeed computed none) stay on the device until
    one of them is read, then both come over in one transfer
    (``partial_fc.readout.DeviceScalars``): the trainer reads them every ``log.every`` steps,
    so a step does not wait for its own numbers.
    """

    lr: float
    skipped: bool  # neither the backbone nor the head was updated (see Engine.step)
    overflow: bool  # skipped for DeepSpeed's fp16 loss scaler alone: not a bad step
    stop: StopRequest  # the stop request agreed over the ranks (the largest reason)
    numbers: Mapping[str, float] = field(repr=False)  # {"loss", "grad_norm"}, read lazily
    angles: dict[str, Tensor] | None = None  # PartialFC.angle_sample, when asked for
    head_stats: Mapping[str, float] = field(default_factory=dict, repr=False)  # head.stats
    notes: tuple[str, ...] = ()  # the head's new start-up lines (PartialFC.take_notes)

    @property
    def loss(self) -> float:
        return self.numbers["loss"]

    @property
    def grad_norm(self) -> float:
        return self.numbers["grad_norm"]


class Engine:
    """Backbone engine + head + both optimizers + the LR schedule; ``step`` does one update.

    Build on every rank of ``env.group`` (:func:`trainer.dist.attach`) after the process
    group is up. ``head`` is a ``partial_fc.PartialFC`` on that same group (its
    ``process_group``); ``backbone`` is the bare module (kept as ``self.backbone`` for
    evaluation and checkpoints), run by ``self.backend`` (``engine.type``: :data:`BACKENDS`).
    ``self.prefetch`` wraps the loop's batches: their copy to the GPU queued as they come
    (``trainer.engine.prefetch``).
    """

    def __init__(
        self,
        cfg: Config,
        backbone: nn.Module,
        head: nn.Module,
        env: DistEnv,
        total_steps: int,
        warmup_steps: int,
        distillation: Teacher | None = None,
    ):
        self.cfg, self.env, self.device = cfg, env, env.device
        self.distillation = distillation
        self.memory_format = self._cuda_settings()  # the input's
        held = (self.memory_format if BACKENDS[cfg.engine.type].channels_last_parameters
                else torch.contiguous_format)
        self.backbone = backbone.to(self.device, memory_format=held)
        self.head = head.to(self.device)
        self.head_optimizer = make_head_optimizer(cfg.optim, self.head.weight,
                                                  cfg.head.max_update_mib << 20,
                                                  dense=cfg.head.update == "dense",
                                                  fused=cfg.engine.fused_updates)
        self.optimizer = make_optimizer(cfg.optim, self.backbone)
        self.lr_factor = lr_factor(cfg.schedule, warmup_steps, total_steps)
        trained = self._compiled() if cfg.engine.compile else self.backbone
        # Not with stored teacher embeddings: their lookup reads the flip bits on the host.
        stored = distillation is not None and distillation.offline is not None
        self.prefetch = Prefetch(self.device, cfg.engine.prefetch and not stored)
        self.backend = BACKENDS[cfg.engine.type](cfg, trained, self.backbone, self.optimizer, env)
        # train.global_batch: a step's statistics do not depend on its split into passes
        self.step_statistics = cfg.train.global_batch is not None and moves_statistics(head.margin)
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
        included; this keeps it eager, its state_dict keys free of ``_orig_mod.``. Off CUDA,
        inductor's layout optimisation is off: it would pick channels_last for the
        convolutions, whose CPU backward crashes as :meth:`_cuda_settings` says (seen again
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

    def _head_operands(self):
        """A bf16 run gives the head bf16 matmul operands (fp32 accumulation; its softmax,
        loss and statistics stay fp32: ``PartialFC`` under autocast), as insightface's
        autocast head does; fp32 operands would cost the Triton kernels IEEE fp32 dots on the
        CUDA cores (docs/kernels.md, "Calling for speed"). An fp16 run keeps fp32 operands:
        the head's backward is not loss-scaled, and fp16 flushes ``dL/dcos`` entries below
        2^-24 to zero (``s p / N`` of a non-target at a million classes is about that)."""
        if self.cfg.engine.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(
        self,
        step: int,
        micro_batches: Sequence[tuple[torch.Tensor, ...]],
        angles: bool = False,
        stops: StopRequests | None = None,
        teachers: Sequence[Tensor | None] | None = None,
    ) -> StepResult:
        """One optimisation step over its micro-batches (``train.grad_accum``, or with
        ``train.global_batch`` this rank's share of them) of uint8 images + labels (+ the flip
        bits of a loader that defers its flip to the device: ``(images, labels, flips)``).
        With ``train.global_batch`` and more than one, a head whose statistics move first
        takes them over the whole step (:mod:`trainer.engine.step_statistics`).

        ``stops`` (this rank's requests, ``trainer.stopping``) is read when the step's one
        all-reduce (``trainer.engine.backend.Verdict``) agrees on it with the step's flags,
        after the backward: a stop signal that came while the step ran is in it, and every
        rank stops after the same step at no extra host read. ``angles=True`` also samples
        ``PartialFC.angle_sample`` on the last micro-batch (collective). ``teachers``: with
        ``distillation``, each micro-batch's stored teacher embeddings (offline), or None
        (the online teacher runs): the distillation loss joins the margin loss (below).

        The step is skipped, on every rank alike, when the loss, an embedding gradient, the
        head gradient or the backbone gradient norm was not finite (the verdict, or the
        backend's own overflow check: ``trainer.engine.backend``): then neither the backbone
        nor the head is updated, both optimizers' states and every buffer (BatchNorm
        statistics, the AdaCos scale) are as before the step, and the gradients are cleared.
        The labels are not range-checked here (``PartialFC.forward``'s ``trusted_labels``):
        the run's loaders refuse a label outside ``[0, data.num_classes)`` before it reaches
        the step, and ``trainer.build.build`` refuses a loader of another class count.

        Host reads (each makes the CPU wait for the device; tests/trainer/test_engine_syncs.py
        holds the budget): one, the verdict, read after the backbone's backward to decide
        whether the optimizers step. The head gets the batch sizes from
        ``train.batch_size`` (the loader's batches are equal), not from an exchange.
        ``r < 1`` adds the sampler's (its size depends on the labels); DeepSpeed reads its
        overflow flag in its ``step()``.
        """
        lr = self.set_lr(step)
        saved = Snapshot((self.backbone, self.head), self.head)  # what a skip puts back
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        k, sample = len(micro_batches), None
        teachers = teachers or [None] * k
        distilled: dict[str, Tensor] = {}
        if k > 1:  # one class sample and one head step for all k: exact accumulation
            micro_batches = [(x, self._on_device(y), *f) for x, y, *f in micro_batches]
            embeddings = None
            if self.step_statistics:  # taken over the whole step (engine.step_statistics)
                embeddings = step_embeddings(self._embed, micro_batches, self.backbone,
                                             self.head, self.device)
            with self._head_operands():
                self.head.begin_step(torch.cat([y for _, y, *_ in micro_batches]),
                                     sizes=[k * self.cfg.train.batch_size] * self.env.world_size,
                                     embeddings=embeddings)
        for i, (images, labels, *flips) in enumerate(micro_batches):
            last = i == k - 1
            with self.backend.micro_batch(boundary=last):
                e, y, loss, surrogate = self._forward(images, labels, k, *flips,
                                                      teacher=teachers[i], distilled=distilled)
                finite &= torch.isfinite(loss) & torch.isfinite(e.grad).all()
                loss_sum += loss.detach()  # fp64: the sum Python floats gave
                if not last:
                    self.backend.backward(surrogate)
                    continue
                rows = self.head.pop_sampled_rows()  # the step's one pop, taken or skipped
                grad = self.head.weight.grad
                if grad is not None:
                    finite &= torch.isfinite(grad.sum())
                if angles:
                    sample = self.head.angle_sample(e.detach(), y)
                backbone_finite = self.backend.last_backward(surrogate)
        if backbone_finite is not None:
            finite &= backbone_finite
        stop = NO_STOP if stops is None else stops.current()
        verdict = Verdict.agree(finite, stop, self.env.group)
        update = self.backend.update(verdict, step)
        _, agreed_stop = verdict.read()  # the step's one host read
        self._update_head(update.applied, rows, saved)
        return StepResult(lr=lr, skipped=not update.applied, overflow=update.overflow,
                          stop=agreed_stop, angles=sample, head_stats=self.head.stats,
                          notes=tuple(self.head.take_notes()),
                          numbers=DeviceScalars({"loss": loss_sum / k,
                                                 "grad_norm": update.grad_norm,
                                                 **{key: value / k
                                                    for key, value in distilled.items()}}))

    def _forward(self, images: Tensor, labels: Tensor, k: int, flips: Tensor | None = None,
                 teacher: Tensor | None = None, distilled: dict[str, Tensor] | None = None
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One micro-batch: the backbone's forward, the head's forward and backward on the
        detached embeddings, and the backbone's surrogate loss (module docstring, step 2).
        ``flips``: the rows to mirror, from a loader that defers its flip to here.
        With ``distillation``, ``weight * distill_loss(e, teacher)`` (a global-batch mean,
        ``partial_fc.distill``) is added before the backward, so ``e.grad`` holds the
        gradient of both and the surrogate carries it unchanged; its value and the
        student-teacher cosines are summed into ``distilled`` (``distill_*`` metrics).
        Returns ``(e, labels, loss, surrogate)``: ``e`` the head's fp32 input holding
        ``dL_global/de_local`` in ``e.grad``; ``loss`` is the margin loss alone."""
        x = self._model_input(images, flips)
        y = self._on_device(labels)
        with self.backend.autocast():
            emb = self.backend.model(x)
        e = emb.detach().float().requires_grad_()
        sizes = [self.cfg.train.batch_size] * self.env.world_size  # the global batch's split
        with self._head_operands():
            loss = self.head(e, y, sizes=sizes, trusted_labels=True)
        loss = seams.HEAD_LOSS(loss, rank=self.env.rank)
        total = loss
        if self.distillation is not None:
            teacher = self.distillation.teacher(x, teacher)
            total = loss + self._distill(e, teacher, sizes, distilled)
        (total / k).backward()
        return e, y, loss, (emb.float() * (e.grad * self.env.world_size)).sum()

    def _model_input(self, images: Tensor, flips: Tensor | None = None) -> Tensor:
        """A loader's uint8 images on the device, mirrored where ``flips`` says, normalised,
        in the backend's input dtype and the run's memory format."""
        x = normalize_images(self._on_device(images),
                             None if flips is None else self._on_device(flips))
        return x.to(dtype=self.backend.input_dtype, memory_format=self.memory_format)

    def _embed(self, images: Tensor, flips: Tensor | None = None) -> Tensor:
        """The backbone's embeddings of a micro-batch, as a pass computes them."""
        with self.backend.autocast():
            return self.backend.model(self._model_input(images, flips))

    def _distill(self, e: Tensor, teacher: Tensor, sizes: list[int],
                 distilled: dict[str, Tensor]) -> Tensor:
        """``weight * distill_loss``, its value and cosine summary added into ``distilled``;
        ``sizes``: each rank's rows of the global batch."""
        d = self.distillation
        value = distill_loss(d.loss, e, teacher, sizes, self.env.group)
        terms = {names.DISTILL_LOSS: value.detach(),
                 **{names.DISTILL_COS_PREFIX + name: v
                    for name, v in cosine_summary(e, teacher, sizes, self.env.group).items()}}
        for key, v in terms.items():
            distilled[key] = distilled.get(key, 0.0) + v
        return d.weight * value

    def _on_device(self, batch: Tensor) -> Tensor:
        """``batch`` (images, labels or flip bits) on the run's device; from the loader's pinned
        memory the copy to a GPU is asynchronous, so the host does not wait for it."""
        return batch.to(self.device, non_blocking=True)

    def _update_head(self, applied: bool, rows: SampledRows, saved: Snapshot) -> None:
        """The head follows the backbone: its optimizer steps on this step's ``rows`` when the
        backbone's update was applied; otherwise those rows are not updated (the value is
        dropped) and every buffer and the head's step are put back (``saved``)."""
        if applied:
            self.head_optimizer.step(rows)
        else:
            saved.restore()
        self.head_optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> EngineState:
        """The training state by section (``trainer.engine.state``); collective (the backend
        gathers a partitioned optimizer state into full form)."""
        head = self.head

        def rows(value: Tensor) -> Tensor | Rows:  # K weight rows per class (sub-centers)
            value = torch.as_tensor(value)
            per_row = value.ndim >= 1 and value.shape[0] == head.weight.shape[0]
            return (Rows(value, head.row_start, head.num_classes * head.subcenters) if per_row
                    else value)

        return EngineState(
            head={k: rows(v) if k == "weight" else v for k, v in head.state_dict().items()},
            head_optimizer={k: rows(v) for k, v in self._head_optimizer_state().items()},
            backbone=dict(self.backbone.state_dict()),
            backbone_optimizer=self.backend.optimizer_state())

    def load_state_dict(self, state: EngineState) -> None:
        """Load :meth:`state_dict`'s sections, rows already this rank's; collective."""
        self.head.load_state_dict(state.head)
        head_opt = self._head_optimizer_state()
        head_opt.clear()
        head_opt.update({k: v.to(self.head.weight.device)
                         for k, v in state.head_optimizer.items()})
        self.backbone.load_state_dict(state.backbone)
        self.backend.load_optimizer_state(state.backbone_optimizer)

    def _head_optimizer_state(self) -> dict:
        return self.head_optimizer.state.setdefault(self.head.weight, {})

    def eval_context(self):
        """Autocast for evaluating ``self.backbone`` when DeepSpeed holds it in bf16/fp16."""
        dtype = self.backend.input_dtype
        if dtype != torch.float32:
            return torch.autocast(self.device.type, dtype=dtype)
        return contextlib.nullcontext()
