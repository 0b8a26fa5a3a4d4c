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
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

__all__ = ["BatchNorm1d", "BatchNorm2d"]


class _Fp32AffineWhenCast:
    """Mixin for ``nn.BatchNorm*``: see the module docstring."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = self.running_mean
        if self.weight is None or stats is None or self.weight.dtype == stats.dtype:
            return super().forward(x)
        # The same module with fp32 views of weight and bias (buffers are the real ones, so the
        # running statistics update in place); that call takes the branch above.
        fp32 = {"weight": self.weight.to(stats.dtype), "bias": self.bias.to(stats.dtype)}
        return functional_call(self, fp32, (x,), strict=False)


class BatchNorm1d(_Fp32AffineWhenCast, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` whose statistics stay fp32 under bf16/fp16 parameters."""


class BatchNorm2d(_Fp32AffineWhenCast, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose statistics stay fp32 under bf16/fp16 parameters."""
