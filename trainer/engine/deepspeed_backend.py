"""The backbone under DeepSpeed: its config, import, initialisation, and backward + step.

``trainer.engine.Engine`` runs the backbone under DDP or DeepSpeed (``engine.type``); this
module holds everything DeepSpeed needs that DDP does not, so that the engine's step reads
the same for both: the JSON config, importing DeepSpeed for the run's device, wrapping the
backbone (:class:`DeepSpeedBackbone`), and deciding on each optimisation step whether
DeepSpeed applied the update (its overflow checks, the fp32 no-ZeRO case it does not check,
its fp16 loss scaler's dead end, :class:`LossScaleFloor`). The head is never in here
(docs/design.md, invariant 2).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import warnings

import torch
from torch import nn

from trainer.config import Config


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


class LossScaleFloor(RuntimeError):
    """fp16: the gradients overflow even at DeepSpeed's smallest loss scale (all ranks alike)."""


def loss_scale_overflow(dropped: bool, bad: bool, precision: str) -> bool:
    """Whether DeepSpeed dropped this step for its fp16 loss scaler only.

    ``dropped``: DeepSpeed did not apply the update (``was_step_applied``; always False under
    DDP); ``bad``: the engine's own all-reduced check found a non-finite loss or
    embedding/head gradient; ``precision``: ``engine.precision``. In fp16 a drop with finite
    loss and head gradients means the *scaled* backbone gradients overflowed: the scaler
    halves its scale and goes on. That is the normal start of an fp16 run (the scale begins
    at 2^16), counted as ``skipped_steps`` and not towards ``train.max_bad_steps``; a
    backbone that really diverges drives the scale to its minimum, where DeepSpeed stops the
    run itself. In bf16/fp32 there is no scale, so a drop is a non-finite gradient (a bad
    step).
    """
    return dropped and not bad and precision == "fp16"


class DeepSpeedBackbone:
    """``deepspeed.initialize`` of the backbone and its torch optimizer, on every rank.

    ``model`` is DeepSpeed's engine (what the training step calls forward on); ``backbone``
    the bare module whose parameters it trains, ``optimizer`` the torch optimizer handed to
    DeepSpeed (both kept for the fp32 no-ZeRO undo in :meth:`backward`). ``input_dtype`` is
    the dtype DeepSpeed holds the parameters in (bf16/fp16/fp32), which the images must have.
    """

    def __init__(self, cfg: Config, module: nn.Module, backbone: nn.Module,
                 optimizer: torch.optim.Optimizer, device: torch.device, world_size: int):
        deepspeed = import_deepspeed(device)
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
        if device.type == "cpu" and not cfg.engine.cpu_shm_comm:
            # DeepSpeed JIT-builds a shared-memory all-reduce for CPU on first use (30-50 s);
            # without it its collectives go through the gloo group (config: engine.cpu_shm_comm).
            deepspeed_ops.__compatible_ops__["deepspeed_shm_comm"] = False
        self.model, _, _, _ = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            config=deepspeed_config(cfg, world_size),
            dist_init_required=False,
        )
        self.backbone, self.optimizer = backbone, optimizer
        self.input_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            cfg.engine.precision, torch.float32
        )

    def backward(self, surrogate: torch.Tensor, boundary: bool, step: int) -> bool:
        """DeepSpeed's backward + step for one micro-batch; True when the update was dropped.

        DeepSpeed has no public "skip this step" call, but its ZeRO, bf16 and fp16 optimizers
        drop a step whose reduced gradients are not finite (``check_grad_overflow``; the
        gradient reduction makes that decision the same on every rank) and say so through
        ``was_step_applied()``. A step the engine's flags call bad arrives with a NaN
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

    def grad_norm(self) -> float | torch.Tensor:
        """The backbone's gradient norm of the last step as DeepSpeed computed it; NaN when
        it computed none."""
        norm = self.model.get_global_grad_norm()
        return norm if norm is not None else math.nan

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

    def _checks_overflow(self) -> bool:
        """Whether DeepSpeed's optimizer checks the gradients for inf/NaN before a step."""
        model = self.model
        return model.zero_optimization() or model.bfloat16_enabled() or model.fp16_enabled()
