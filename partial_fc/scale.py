"""The logit scale ``s``: fixed, or AdaCos (arXiv:1905.00292) fixed / dynamic.

The scale multiplies every cosine logit. AdaCos chooses it from the number of classes
(fixed, Sec. 4.1) or re-estimates it every training step from batch statistics (dynamic,
Sec. 4.2). The statistics themselves (``B_avg``, ``theta_med``) are computed by the head
over the **global** batch and all class shards; this module only holds the state and the
formulas, so it needs no process group.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = [
    "AdaCosScale",
    "FixedScale",
    "dynamic_adacos_scale",
    "fixed_adacos_scale",
    "log_mean_exp",
    "median_angle",
]


def fixed_adacos_scale(num_classes: int) -> float:
    """AdaCos fixed scale ``s = sqrt(2) * ln(C - 1)`` (arXiv:1905.00292 Sec. 4.1)."""
    if num_classes < 3:
        raise ValueError(f"AdaCos: num_classes={num_classes} must be >= 3 (s = sqrt(2)*ln(C-1))")
    return math.sqrt(2.0) * math.log(num_classes - 1)


def dynamic_adacos_scale(log_b_avg: Tensor, theta_med: Tensor) -> Tensor:
    """AdaCos dynamic scale ``s_t = ln(B_avg) / cos(min(pi/4, theta_med))`` (Sec. 4.2).

    ``log_b_avg`` is ``ln B_avg`` (taken in log space so a large ``s`` cannot overflow
    ``exp``), ``theta_med`` the median target angle in radians; both 0-d fp32 tensors.
    """
    return log_b_avg / torch.cos(torch.clamp(theta_med, max=math.pi / 4))


def log_mean_exp(log_values: Tensor) -> Tensor:
    """``ln(mean(exp(x)))`` of a 1-D tensor, stable for large ``x`` (used for ``ln B_avg``)."""
    return torch.logsumexp(log_values, dim=0) - math.log(log_values.numel())


def median_angle(target_cos: Tensor) -> Tensor:
    """Median of ``acos(cos)`` over a 1-D tensor of target cosines, in radians.

    For an even count this is the lower of the two middle angles (``torch.median``, as the
    AdaCos reference implementation). The input is clamped to [-1, 1] (rounding can push a
    normalised dot product just past 1).
    """
    return torch.median(torch.acos(target_cos.float().clamp(-1.0, 1.0)))


class FixedScale(nn.Module):
    """A constant ``s`` (NormFace, arXiv:1704.06369; the ``s`` of CosFace and ArcFace). No state."""

    dynamic = False

    def __init__(self, s: float) -> None:
        super().__init__()
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"margin: s={s} must be a finite number > 0")
        self.s = float(s)

    def reset(self, num_classes: int) -> None:
        """Nothing to do: a fixed scale does not depend on the number of classes."""

    def value(self) -> float:
        return self.s

    def extra_repr(self) -> str:
        return f"s={self.s}"


class AdaCosScale(nn.Module):
    """AdaCos scale with its state in the buffer ``s`` (0-d fp32, identical on all ranks).

    ``reset(C)`` sets ``s = sqrt(2) ln(C-1)`` (the fixed value and ``s_0`` of the dynamic
    variant); the head calls it once at construction, a loaded ``state_dict`` overrides it,
    so a resumed run continues with the saved ``s``. ``update`` moves ``s`` only when
    ``dynamic`` and in training mode: ``eval()`` freezes it.
    """

    def __init__(self, dynamic: bool) -> None:
        super().__init__()
        self.dynamic = bool(dynamic)
        self.register_buffer("s", torch.zeros((), dtype=torch.float32))

    def reset(self, num_classes: int) -> None:
        with torch.no_grad():
            self.s.fill_(fixed_adacos_scale(num_classes))

    def value(self) -> Tensor:
        return self.s

    @torch.no_grad()
    def update(self, log_b_avg: Tensor, theta_med: Tensor, valid: Tensor | None = None) -> None:
        """Replace ``s`` by ``dynamic_adacos_scale`` of this step's global statistics.

        Call before computing the step's logits: AdaCos uses ``s_t`` for step ``t`` itself
        (``B_avg`` having been measured with ``s_{t-1}``). No-op unless dynamic and training.
        ``valid`` (0-d bool): where False, ``s`` stays (the statistics had no negative class);
        a tensor, so the decision needs no host read.
        """
        if self.dynamic and self.training:
            new = dynamic_adacos_scale(log_b_avg.float(), theta_med.float())
            self.s.copy_(new if valid is None else torch.where(valid, new, self.s))

    def extra_repr(self) -> str:
        return f"dynamic={self.dynamic}"
