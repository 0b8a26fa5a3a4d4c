"""The backbone under DeepSpeed (``engine.type=deepspeed``): its config, import, wrapping,
backward + step, and its optimizer state in a checkpoint.

Everything DeepSpeed needs that DDP does not lives here, behind
:class:`trainer.engine.backend.BackboneBackend`: the JSON config, importing DeepSpeed for the
run's device, ``deepspeed.initialize`` (:class:`DeepSpeedBackend`), deciding on each
optimisation step whether DeepSpeed applied the update (its overflow checks, the fp32
no-ZeRO case it does not check, its fp16 loss scaler's dead end, :class:`LossScaleFloor`),
and reading and writing the ZeRO partitions of its optimizer state
(:class:`ZeroPartitions`, the one place that touches DeepSpeed internals). The head is
never in here (docs/design.md, invariant 2).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import warnings
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from trainer.config import Config
from trainer.config.accumulation import accumulation
from trainer.dist import DistEnv
from trainer.engine.backend import (
    Update,
    Verdict,
    load_torch_optimizer_state,
    torch_optimizer_state,
)
from trainer.errors import Stopped


def deepspeed_config(cfg: Config, world_size: int) -> dict:
    """The DeepSpeed JSON for the backbone. The optimizer is passed as a torch object;
    ``engine.zero_settings`` go into ``zero_optimization`` as DeepSpeed reads them
    (``overlap_comm`` and ``contiguous_gradients`` as booleans)."""
    micro, accum = cfg.train.batch_size, accumulation(cfg.train, world_size)
    flags = ("overlap_comm", "contiguous_gradients")
    zero = {key: bool(value) if key in flags else value
            for key, value in cfg.engine.zero_settings.items()}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world_size,
        "zero_optimization": {"stage": cfg.engine.zero_stage, **zero},
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


class _TestedHere(logging.Filter):
    """Drops DeepSpeed's ``You are using ZeRO with an untested optimizer`` warning.

    ZeRO's list of tested optimizers holds Adam-like ones only; ours is SGD with momentum,
    whose update is elementwise, so stepping it on each rank's partition of the parameters
    (ZeRO-1/2) is the same update as on the whole. DeepSpeed refuses it unless the config
    says ``zero_allow_untested_optimizer`` (:func:`deepspeed_config` does) and then warns on
    every run anyway, which no config key turns off. Checked here instead:
    tests/trainer/test_engine.py compares DeepSpeed ZeRO-1's steps with DDP's.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "untested optimizer" not in record.getMessage()


def overflow_unless(apply: Tensor, surrogate: Tensor) -> Tensor:
    """``surrogate`` when ``apply`` (a 0-d bool tensor on the device) holds, else a surrogate
    whose backward makes every backbone gradient non-finite; no host read either way.

    This is how a step the engine's verdict turns down is dropped on DeepSpeed: DeepSpeed
    0.19 has no public call that skips an optimisation step (``engine.step()`` at the
    accumulation boundary always steps; its gradients are already reduced into ZeRO's
    partitions by then), but its ZeRO, bf16 and fp16 optimizers drop a step whose gradients
    are not finite and report it through ``was_step_applied()``. The one place the backend
    relies on that; ``tests/trainer/test_backends.py`` checks both branches.
    """
    return surrogate * torch.where(apply, 1.0, math.inf)


class LossScaleFloor(Stopped, RuntimeError):
    """fp16: the gradients overflow even at DeepSpeed's smallest loss scale (all ranks alike)."""


def loss_scale_overflow(dropped: bool, bad: bool, precision: str) -> bool:
    """Whether DeepSpeed dropped this step for its fp16 loss scaler only.

    ``dropped``: DeepSpeed did not apply the update (``was_step_applied``); ``bad``: the
    engine's own all-reduced check found a non-finite loss or embedding/head gradient;
    ``precision``: ``engine.precision``. In fp16 a drop with finite loss and head gradients
    means the *scaled* backbone gradients overflowed: the scaler halves its scale and goes
    on. That is the normal start of an fp16 run (the scale begins at 2^16), counted as
    ``skipped_steps`` and not towards ``train.max_bad_steps``; a backbone that really
    diverges drives the scale to its minimum, where DeepSpeed stops the run itself. In
    bf16/fp32 there is no scale, so a drop is a non-finite gradient (a bad step).
    """
    return dropped and not bad and precision == "fp16"


class DeepSpeedBackend:
    """:class:`trainer.engine.backend.BackboneBackend` over ``deepspeed.initialize`` of the
    backbone and its torch optimizer, on every rank. DeepSpeed takes no group argument: it
    runs on its own groups cloned from the default one, the ranks of ``env.group``.

    ``model`` is DeepSpeed's engine (what the training step calls forward on); ``backbone``
    the bare module whose parameters it trains, ``optimizer`` the torch optimizer handed to
    DeepSpeed (both kept for the fp32 no-ZeRO undo in :meth:`_boundary_step`).
    ``input_dtype`` is the dtype DeepSpeed holds the parameters in (bf16/fp16/fp32), which
    the images must have; there is no autocast. ``precision`` (``engine.precision``) tells
    a loss-scale skip from a bad step (:func:`loss_scale_overflow`).
    """

    # DeepSpeed broadcasts each parameter as bytes at start-up (``p.data.view(torch.uint8)``
    # in ``DeepSpeedEngine._broadcast_model``), which needs a unit last stride: a
    # channels_last convolution weight fails there ("self.stride(-1) must be 1", the first
    # GPU run, 2026-11-27). ZeRO then points every parameter into its contiguous flat buffers
    # anyway. The input stays channels_last, so cuDNN still runs NHWC kernels (it takes that
    # layout when the input or the weight has it).
    channels_last_parameters = False

    def __init__(self, cfg: Config, module: nn.Module, backbone: nn.Module,
                 optimizer: torch.optim.Optimizer, env: DistEnv):
        deepspeed = import_deepspeed(env.device)
        from deepspeed import ops as deepspeed_ops

        ds_logger = logging.getLogger("DeepSpeed")
        ds_logger.setLevel(logging.WARNING)
        if not any(isinstance(f, _TestedHere) for f in ds_logger.filters):
            ds_logger.addFilter(_TestedHere())
        # DeepSpeed 0.19's ZeRO calls torch's deprecated all_gather_into_tensor every step;
        # the FutureWarning is theirs to fix and would flood the log on every rank.
        warnings.filterwarnings(
            "ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning
        )
        if env.device.type == "cpu" and not cfg.engine.cpu_shm_comm:
            # DeepSpeed JIT-builds a shared-memory all-reduce for CPU on first use (30-50 s);
            # without it its collectives go through the gloo group (config: engine.cpu_shm_comm).
            deepspeed_ops.__compatible_ops__["deepspeed_shm_comm"] = False
        self.model, _, _, _ = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            config=deepspeed_config(cfg, env.world_size),
            dist_init_required=False,
        )
        self.backbone, self.optimizer = backbone, optimizer
        self._surrogate: Tensor | None = None  # the last micro-batch's, for update
        self.precision = cfg.engine.precision
        self.input_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            cfg.engine.precision, torch.float32
        )

    def micro_batch(self, boundary: bool):
        """Nothing: DeepSpeed reduces the gradients at its own accumulation boundary."""
        return contextlib.nullcontext()

    def autocast(self):
        """Nothing: DeepSpeed holds the parameters in ``input_dtype`` itself."""
        return contextlib.nullcontext()

    def backward(self, surrogate: Tensor) -> None:
        self.model.backward(surrogate, scale_wrt_gas=False)
        self.model.step()  # before the boundary: DeepSpeed only counts the micro-step

    def last_backward(self, surrogate: Tensor) -> None:
        """Nothing yet: DeepSpeed can drop a step only through its own overflow check of the
        gradients its backward makes, so the backward waits for the verdict (:meth:`update`).
        DeepSpeed checks the backbone's gradients itself: no finite flag of its own."""
        self._surrogate = surrogate

    def update(self, verdict: Verdict, step: int) -> Update:
        """DeepSpeed's backward of the last micro-batch and its step, dropped unless the
        verdict is for it (:func:`overflow_unless`); in fp16 a step DeepSpeed dropped on a
        verdict for it is a loss-scale overflow (:func:`loss_scale_overflow`)."""
        surrogate, self._surrogate = self._surrogate, None
        self.model.backward(overflow_unless(verdict.apply, surrogate), scale_wrt_gas=False)
        dropped = self._boundary_step(step)
        applies = verdict.applies
        return Update(applied=applies and not dropped,
                      overflow=loss_scale_overflow(dropped, not applies, self.precision),
                      grad_norm=self._grad_norm())

    def _boundary_step(self, step: int) -> bool:
        """DeepSpeed's step at the boundary; True when the update was dropped.

        DeepSpeed has no public "skip this step" call, but its ZeRO, bf16 and fp16 optimizers
        drop a step whose reduced gradients are not finite (``check_grad_overflow``; the
        gradient reduction makes that decision the same on every rank) and say so through
        ``was_step_applied()``. Without ZeRO in fp32 DeepSpeed steps the plain torch
        optimizer with no such check: there the (all-reduced, so identical) gradients are
        checked here, and a dropped step is stepped on zeroed gradients and then undone
        (parameters and optimizer state put back).
        """
        if self._checks_overflow():
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

    def _grad_norm(self) -> float | Tensor:
        """The backbone's gradient norm of the last step as DeepSpeed computed it; NaN when
        it computed none."""
        norm = self.model.get_global_grad_norm()
        return norm if norm is not None else math.nan

    def _scaled_step(self, step: int) -> None:
        """DeepSpeed's step, its fp16 loss scaler's dead end as :class:`LossScaleFloor`.

        The scaler halves its scale on each overflow and, on an overflow at its minimum
        (``fp16.min_loss_scale``, 1), raises a bare ``Exception`` instead
        (deepspeed/runtime/fp16/loss_scaler.py ``DynamicLossScaler.update_scale``; DeepSpeed
        0.19 has no type of its own for it, and no config key turns the raise off). Told from
        a bug by its type and the scaler's state, not its text: exactly ``Exception`` (no
        subclass) raised while the scaler stands at its minimum (:meth:`_at_scale_floor`).
        Every rank reaches it on the same step (the overflow check is all-reduced).
        """
        try:
            self.model.step()
        except Exception as err:
            if type(err) is not Exception or not self._at_scale_floor():
                raise
            raise LossScaleFloor(
                f"step {step + 1}: fp16 gradients overflow even at DeepSpeed's minimum loss "
                "scale: the backbone diverges; lower optim.lr, or train with "
                "engine.precision=bf16"
            ) from None

    def _at_scale_floor(self) -> bool:
        """Whether DeepSpeed's dynamic fp16 loss scaler stands at its minimum scale: its
        optimizer's ``loss_scale`` (a property of DeepSpeed's fp16 and ZeRO optimizers) against
        the engine's ``dynamic_loss_scale_args()`` (the ``fp16`` config's ``min_loss_scale``)."""
        from deepspeed.runtime.fp16.loss_scaler import MIN_LOSS_SCALE

        model = self.model
        if self.precision != "fp16" or not model.dynamic_loss_scale():
            return False
        return model.optimizer.loss_scale <= model.dynamic_loss_scale_args()[MIN_LOSS_SCALE]

    def _checks_overflow(self) -> bool:
        """Whether DeepSpeed's optimizer checks the gradients for inf/NaN before a step."""
        model = self.model
        return model.zero_optimization() or model.bfloat16_enabled() or model.fp16_enabled()

    def optimizer_state(self) -> dict[str, Tensor]:
        """The plain torch optimizer's state, or with ZeRO/bf16 the fp32 master weights
        (``fp32.<param>``), the per-element optimizer state gathered in full form
        (``opt.<param>.<key>``) and its scalars (``opt_scalar.<key>``)
        through DeepSpeed's tensor-fragment API (collective). Full form is what makes
        ZeRO-1/2 state reshardable."""
        zero = ZeroPartitions.of(self)
        if zero is None:
            return torch_optimizer_state(self.backbone, self.optimizer)
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        zero.link_state()
        keys, scalars = zero.state_keys()
        out = {f"opt_scalar.{k}": v for k, v in scalars.items()}
        for name, p in self.trainable().items():
            out[f"fp32.{name}"] = safe_get_full_fp32_param(p).cpu()
            for key in keys:
                out[f"opt.{name}.{key}"] = safe_get_full_optimizer_state(p, key).cpu()
        return out

    def load_optimizer_state(self, state: Mapping[str, Tensor]) -> None:
        """Put :meth:`optimizer_state`'s entries back; with ZeRO/bf16 the partitions' state is
        created first (:meth:`ZeroPartitions.create_state`), then filled per parameter
        (collective)."""
        zero = ZeroPartitions.of(self)
        if zero is None:
            load_torch_optimizer_state(self.backbone, self.optimizer, state)
            return
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        prefix = "opt_scalar."
        scalars = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        keys = sorted({k.rsplit(".", 1)[1] for k in state if k.startswith("opt.")})
        zero.create_state(keys, scalars)
        for name, p in self.trainable().items():
            safe_set_full_fp32_param(p, state[f"fp32.{name}"].to(p.device))
            for key in keys:
                safe_set_full_optimizer_state(p, state[f"opt.{name}.{key}"].to(p.device), key)

    def master_weights(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """With ZeRO/bf16/fp16 the fp32 master weights (``fp32.<param>``); none otherwise."""
        return {k[len("fp32."):]: v for k, v in state.items() if k.startswith("fp32.")}

    def trainable(self) -> dict[str, nn.Parameter]:
        """Backbone parameters the optimizer owns (frozen ones live in the state_dict only)."""
        return {n: p for n, p in self.backbone.named_parameters() if p.requires_grad}


class ZeroPartitions:
    """The one place this project touches DeepSpeed internals (DeepSpeed 0.19).

    ZeRO-1/2 and the bf16 optimizer keep the backbone's fp32 master weights and optimizer
    state as flat per-group partitions. DeepSpeed's public tensor-fragment API
    (``deepspeed.utils.safe_get/set_full_*``) reads and writes them per parameter, but there
    is no public call that creates the optimizer state before the first step, which a resume
    must fill: that needs the partitions and their parameter groups, named below.
    ``tests/trainer/test_checkpoint.py::test_deepspeed_internals_are_where_the_backend_expects``
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
                            f"has not the partitions {__name__} reads ({self.FLAT}, "
                            f"{self.GROUPS}); see ZeroPartitions in {__file__}")
        self.flat = list(getattr(zero_optimizer, names[0]))
        self.groups = list(getattr(zero_optimizer, names[1]))

    @classmethod
    def of(cls, backend: DeepSpeedBackend) -> ZeroPartitions | None:
        """The partitions of ``backend``'s DeepSpeed optimizer, or None when its state is a
        plain torch optimizer's (DeepSpeed without ZeRO in fp32)."""
        params = list(backend.trainable().values())
        # Every rank's parameters carry the attribute (None where another rank holds the
        # fragment), so every rank takes the same branch.
        linked = bool(params) and hasattr(params[0], "_hp_mapping")
        return cls(backend.model.optimizer) if linked else None

    def state_keys(self) -> tuple[list[str], dict[str, Tensor]]:
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

    def create_state(self, keys: list[str], scalars: dict[str, Tensor]) -> None:
        """Zero optimizer state for every partition, linked to the parameters' fragments, so
        ``safe_set_full_optimizer_state`` can fill it (DeepSpeed builds it lazily at the
        first step otherwise)."""
        from deepspeed.utils import lazy_init_hp_params_optimizer_state

        for flat, group in zip(self.flat, self.groups, strict=True):
            self.base.state[flat] = {k: torch.zeros_like(flat) for k in keys}
            self.base.state[flat].update({k: v.clone() for k, v in scalars.items()})
            lazy_init_hp_params_optimizer_state(group, flat, self.base.state)
