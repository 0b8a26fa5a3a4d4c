"""Optimizers for ``PartialFC.weight`` that leave unsampled rows alone.

With ``sample_rate < 1`` most rows of a shard take no part in a step; their gradient is 0,
but a plain ``torch.optim.SGD`` would still move them by momentum and weight decay, and
``AdamW`` by its moments. These optimizers update only the rows the head reports
(``head.pop_sampled_rows()``: the rows used by its forwards since the previous ``step``):
unsampled rows, and their momentum / moment buffers, stay bit-identical. With
``sample_rate == 1`` they reduce exactly to ``torch.optim.SGD`` (no dampening, no Nesterov)
and ``torch.optim.AdamW``.

They are ``torch.optim.Optimizer`` subclasses over ``[head.weight]`` with the usual
``param_groups`` (``lr`` etc.), so LR schedulers and ``state_dict()`` work. State per rank:
SGD ``momentum_buffer`` ``[num_local, D]``; AdamW ``exp_avg``, ``exp_avg_sq`` ``[num_local, D]``
and ``step`` ``[num_local]`` (fp32, per-row update counts: a row's bias correction counts only
the steps in which it was sampled, like a "lazy" sparse Adam). All rows of this rank's shard.

At ``sample_rate < 1`` the head's ``weight.grad`` is a row-sparse COO tensor (only the
sampled rows are stored, never a dense ``[num_local, D]`` gradient); the optimizers read it
through ``coalesce().indices()/values()``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from partial_fc.head import PartialFC

__all__ = ["SampledAdamW", "SampledSGD"]


def _dense(grad: Tensor) -> Tensor:
    return grad.to_dense() if grad.is_sparse else grad


def _rows_of(grad: Tensor, rows: Tensor) -> Tensor:
    """``grad[rows]`` for a dense or a row-sparse COO gradient (the head's at ``r < 1``: its
    rows are a subset of ``rows``, the rows the forwards used; several forwards before a step
    leave duplicates, which ``coalesce`` sums)."""
    if not grad.is_sparse:
        return grad[rows]
    grad = grad.coalesce()
    if grad.indices().shape[1] == len(rows):  # the same rows (one forward per step): no copy
        return grad.values()
    out = torch.zeros((len(rows), *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
    return out.index_copy_(0, torch.searchsorted(rows, grad.indices()[0]), grad.values())


class _SampledOptimizer(torch.optim.Optimizer):
    """Shared plumbing: fetch the rows, apply ``_update`` to them, write them back."""

    def __init__(self, head: PartialFC, defaults: dict) -> None:
        if not isinstance(head, PartialFC):
            raise TypeError(f"{type(self).__name__}: expected a PartialFC head, got {head!r}")
        if not defaults["lr"] >= 0:
            raise ValueError(f"{type(self).__name__}: lr={defaults['lr']} must be >= 0")
        if not defaults["weight_decay"] >= 0:
            raise ValueError(f"{type(self).__name__}: weight_decay={defaults['weight_decay']} "
                             "must be >= 0")
        super().__init__([head.weight], defaults)
        self._head = head

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rows = self._head.pop_sampled_rows()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or (rows is not None and rows.numel() == 0):
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                if rows is None:
                    self._update(p, _dense(p.grad), state, group)
                    continue
                sub = {k: v[rows] for k, v in state.items()}
                w = p[rows]
                self._update(w, _rows_of(p.grad, rows), sub, group)
                p[rows] = w
                for k, v in sub.items():
                    state[k][rows] = v
        return loss

    def _init_state(self, p: Tensor, state: dict) -> None:
        raise NotImplementedError

    def _update(self, w: Tensor, g: Tensor, state: dict, group: dict) -> None:
        """Update rows ``w`` in place from gradient ``g`` and row-sliced ``state``."""
        raise NotImplementedError


class SampledSGD(_SampledOptimizer):
    """SGD with momentum and (coupled, L2) weight decay on the sampled rows only:
    ``d = g + wd * w; buf = momentum * buf + d; w -= lr * buf`` (``torch.optim.SGD``)."""

    def __init__(self, head: PartialFC, lr: float, momentum: float = 0.9,
                 weight_decay: float = 5e-4) -> None:
        if not 0 <= momentum < 1:
            raise ValueError(f"SampledSGD: momentum={momentum} must be in [0, 1)")
        super().__init__(head, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    def _init_state(self, p: Tensor, state: dict) -> None:
        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update(self, w: Tensor, g: Tensor, state: dict, group: dict) -> None:
        d = g.add(w, alpha=group["weight_decay"]) if group["weight_decay"] else g
        if group["momentum"]:
            d = state["momentum_buffer"].mul_(group["momentum"]).add_(d)
        w.add_(d, alpha=-group["lr"])


class SampledAdamW(_SampledOptimizer):
    """AdamW (decoupled weight decay, arXiv:1711.05101) on the sampled rows only, with a
    per-row step count for the bias corrections; equals ``torch.optim.AdamW`` when every row
    is sampled every step."""

    def __init__(self, head: PartialFC, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"SampledAdamW: betas={betas} must be in [0, 1)")
        if not eps > 0:
            raise ValueError(f"SampledAdamW: eps={eps} must be > 0")
        super().__init__(head, dict(lr=lr, betas=tuple(betas), eps=eps,
                                    weight_decay=weight_decay))

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, then the per-row ``step`` counts move to the weight's device as fp32
        (torch leaves any ``step`` state where it was saved, e.g. on the CPU after
        ``torch.load(map_location="cpu")``, and row indexing on a CUDA weight then fails)."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            if "step" in state:
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)

    def _init_state(self, p: Tensor, state: dict) -> None:
        state["step"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update(self, w: Tensor, g: Tensor, state: dict, group: dict) -> None:
        beta1, beta2 = group["betas"]
        t = state["step"].add_(1)[:, None]
        w.mul_(1 - group["lr"] * group["weight_decay"])
        m = state["exp_avg"].lerp_(g, 1 - beta1)
        v = state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        t = t.double()  # bias corrections in float64, as torch computes them (Python floats)
        step_size = (group["lr"] / (1 - beta1**t)).to(w.dtype)  # [rows, 1]: per-row
        bias2_sqrt = (1 - beta2**t).sqrt().to(w.dtype)
        w.addcdiv_(m * step_size, (v.sqrt() / bias2_sqrt).add_(group["eps"]), value=-1)
