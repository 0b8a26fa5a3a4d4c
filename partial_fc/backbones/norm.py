"""BatchNorm that keeps working when an engine casts the parameters to bf16/fp16.

DeepSpeed's bf16 and fp16 modes cast a module's *parameters* to the low precision and leave
its *buffers* (BatchNorm's running mean and variance) in fp32. ``torch.batch_norm`` accepts a
low-precision input only when weight, bias and running statistics are all of the input's
dtype or all fp32; the mix DeepSpeed leaves fails on the first step (CUDA: "Expected
running_mean to have type BFloat16 but got Float"; CPU: "expected scalar type BFloat16 but
found Float").

These classes pass the affine parameters as fp32 whenever their dtype differs from the
running statistics', which selects torch's mixed form: statistics computed and accumulated
in fp32 (a bf16 running variance would keep 3 significant digits), output in the input's
dtype, and the parameters' gradients flowing back through the cast. With parameters and
statistics of one dtype (fp32 training, DDP under autocast) they are ``nn.BatchNorm*``.

``freeze_stats`` (set by :mod:`partial_fc.backbones.checkpointing` while it recomputes a
block) makes a training-mode forward normalise with the batch statistics, as always, but
leave the running statistics and ``num_batches_tracked`` untouched: the recomputation of a
checkpointed block must not count its batch a second time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

__all__ = ["BatchNorm1d", "BatchNorm2d", "FreezableStats"]


class FreezableStats:
    """Mixin for ``nn.BatchNorm*``: see the module docstring."""

    freeze_stats = False  # the class default; checkpointing sets it on instances

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = self.running_mean
        if self.freeze_stats and self.training:
            weight, bias = self.weight, self.bias
            if weight is not None and stats is not None and weight.dtype != stats.dtype:
                weight, bias = weight.to(stats.dtype), bias.to(stats.dtype)
            # Copies of the statistics take the update (the backward saves the same tensors
            # as the first run's, which torch.utils.checkpoint checks).
            return F.batch_norm(x, stats.clone(), self.running_var.clone(), weight, bias, True,
                                0.1 if self.momentum is None else self.momentum, self.eps)
        if self.weight is None or stats is None or self.weight.dtype == stats.dtype:
            return super().forward(x)
        # The same module with fp32 views of weight and bias (buffers are the real ones, so the
        # running statistics update in place); that call takes the branch above.
        fp32 = {"weight": self.weight.to(stats.dtype), "bias": self.bias.to(stats.dtype)}
        return functional_call(self, fp32, (x,), strict=False)


class BatchNorm1d(FreezableStats, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` whose statistics stay fp32 under bf16/fp16 parameters."""


class BatchNorm2d(FreezableStats, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose statistics stay fp32 under bf16/fp16 parameters."""
