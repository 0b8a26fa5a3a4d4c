"""Optimizers for ``PartialFC.weight`` that leave unsampled rows alone.

With ``sample_rate < 1`` most rows of a shard take no part in a step; their gradient is 0,
but a plain ``torch.optim.SGD`` would still move them by momentum and weight decay, and
``AdamW`` by its moments. These optimizers update only the rows the head hands them
(``head_opt.step(head.pop_sampled_rows())``: the rows its forwards used since the last pop):
unsampled rows, and their momentum / moment buffers, stay bit-identical. With
``sample_rate == 1`` they reduce exactly to ``torch.optim.SGD`` (no dampening, no Nesterov)
and ``torch.optim.AdamW``.

They are ``torch.optim.Optimizer`` subclasses over ``[head.weight]`` (the Parameter, not the
head; ``step(rows)`` checks that ``rows`` are that weight's and newer than the last taken) with
the usual ``param_groups`` (``lr`` etc.), so LR schedulers and ``state_dict()`` work. State
per rank:
SGD ``momentum_buffer`` ``[num_local, D]``; AdamW ``exp_avg``, ``exp_avg_sq`` ``[num_local, D]``
(these in the weight's dtype) and ``step`` ``[num_local]`` (fp32, per-row update counts: a
row's bias correction counts only the steps in which it was sampled, like a "lazy" sparse
Adam). All rows of this rank's shard.

At ``sample_rate < 1`` the head's ``weight.grad`` is a row-sparse COO tensor (only the
sampled rows are stored, never a dense ``[num_local, D]`` gradient); the optimizers read it
through ``_indices()/_values()``, which PyTorch's sparse documentation names as the way to
read an uncoalesced COO tensor: autograd's accumulation into ``.grad`` drops the coalesced
flag the head's backward sets (even after one backward), so the public ``indices()/values()``
would need ``coalesce()``, an ``[S, D]`` copy, and handing the rows to the optimizer beside
``weight.grad`` would bypass autograd's accumulation and anything done to ``.grad``.

Precision: the update runs in fp32 on fp32 copies of the rows, their gradient and state, and
each tensor is rounded once when written back (round to nearest even). For a bf16 weight
(``PartialFC(state_dtype=torch.bfloat16)``) this stores exactly what the fp32 optimizer would
compute from the same bf16 inputs, rounded to bf16; running the update's 3-6 elementwise ops
in bf16 instead would round after each (relative error up to ``2**-8`` per op, compounding
in the momentum). What bf16 storage still loses: an update below half a bf16 step of the
weight (``|lr * buf| < 2**-9 |w|``, about) rounds away; stochastic rounding would keep it in
expectation at the price of a random stream and statistical tests, and is not done. State
shaped like the weight follows the weight's dtype: state restored from a checkpoint saved
with another dtype is cast at the next step.

Working memory: rows are updated in chunks of ``rows_per_chunk`` rows, sized so that the
update's fp32 temporaries (``TEMPORARIES`` ``[rows, D]`` tensors) stay within
``max_update_bytes`` whatever the number of sampled rows ``S`` (gathering all ``S`` rows at
once held 4 (SGD) or 7 (AdamW) ``[S, D]`` copies: ~10 GB per GPU at 100M classes on 8 GPUs,
r = 0.1). Every formula is elementwise per row, so the chunking changes no bit of the result.
When all rows are updated the chunks are slices, updated in place when fp32 (no copies).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim.sgd import sgd

from partial_fc.rows import SampledRows

__all__ = ["SampledAdamW", "SampledSGD", "rows_per_chunk"]


def rows_per_chunk(max_update_bytes: int, dim: int, temporaries: int) -> int:
    """Rows per update chunk: ``temporaries`` fp32 ``[rows, dim]`` tensors within
    ``max_update_bytes`` (at least one row)."""
    return max(1, max_update_bytes // (temporaries * dim * 4))


class _GradRows:
    """Chunks ``rows[a:b]`` (``rows`` None: rows ``a:b``) of a dense or row-sparse COO
    gradient, without an ``[S, D]`` copy (``coalesce()`` would make one: autograd's
    accumulation drops the coalesced flag). The head's sparse gradient holds a subset of
    ``rows``, the rows its forwards used: several forwards before a step leave duplicates,
    summed here in fp32 (in their order), and a forward without backward adds rows with no
    stored gradient, which read as 0. Finding them reads the host twice (the order check and
    the chunks' bounds), except where ``rows`` say the forwards shared one sample
    (``SampledRows.shared``): the gradient is then that sample's rows ``copies`` times in
    turn, summed without a read."""

    def __init__(self, grad: Tensor, rows: Tensor | None, per: int, one_forward: bool,
                 shared: bool = False) -> None:
        self.grad, self.where, self.order, self.copies = grad, None, None, 1
        if not grad.is_sparse:
            return
        index, total = grad._indices()[0], grad.shape[0] if rows is None else len(rows)
        if one_forward and len(index) == total:  # exactly ``rows``: no host read to check
            return
        if shared and rows is not None and total and len(index) % total == 0:
            self.copies = len(index) // total  # ``rows`` in turn, that often: no host read
            return
        if not bool((index[1:] > index[:-1]).all()):  # duplicates: the forwards' rows in turn
            self.order = torch.argsort(index, stable=True)
            index = index[self.order]
        if self.order is not None or len(index) != total:
            self.where = index if rows is None else torch.searchsorted(rows, index)
            starts = torch.arange(0, total + per, per, device=index.device).clamp_max(total)
            self.bounds = torch.searchsorted(self.where, starts).tolist()  # entries per chunk

    def chunk(self, a: int, b: int, sel: slice | Tensor, per: int) -> Tensor:
        """The gradient of rows ``sel`` (chunk ``a:b``, ``per`` rows a chunk): a view in the
        gradient's dtype where it stores exactly these rows, else fp32."""
        if not self.grad.is_sparse:
            return self.grad[sel]
        values = self.grad._values()
        if self.copies > 1:  # the forwards' gradients of the same rows, summed in their order
            copies = values.view(self.copies, -1, *values.shape[1:])[:, a:b]
            out = copies[0].to(torch.float32, copy=True)
            for part in copies[1:]:
                out += part
            return out
        if self.where is None:  # the same rows (one forward per step): no copy
            return values[a:b]
        lo, hi = self.bounds[a // per], self.bounds[a // per + 1]
        part = values[lo:hi] if self.order is None else values[self.order[lo:hi]]
        out = torch.zeros((b - a, *values.shape[1:]), dtype=torch.float32, device=values.device)
        return out.index_put_((self.where[lo:hi] - a,), part.float(), accumulate=True)


class _SampledOptimizer(torch.optim.Optimizer):
    """Shared plumbing: fetch a chunk of rows as fp32, apply ``_update`` to them, write them
    back, ``rows_per_chunk`` rows at a time. ``ROW_STATE``: state tensors ``[num_local, D]``;
    ``SCRATCH``: fp32 ``[rows, D]`` tensors the formula of ``_update`` allocates.

    ``max_update_bytes``: budget of the fp32 temporaries of one chunk (``temporaries()``
    ``[rows, D]`` tensors: weight, gradient, state and scratch, all copies in the worst case).
    ``dense=True``: every step updates every row of the shard, unsampled ones with a zero
    gradient (momentum, weight decay and AdamW's moments keep moving them): what one
    ``torch.optim.SGD``/``AdamW`` over the whole shard does, as insightface's arcface_torch
    trains Partial FC (arXiv:2203.15565). Costs an ``O(num_local D)`` update per step.
    """

    ROW_STATE = 0
    SCRATCH = 0

    def __init__(self, weight: Tensor, defaults: dict, max_update_bytes: int,
                 dense: bool = False) -> None:
        if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2:
            raise TypeError(f"{type(self).__name__}: expected the head's weight, a 2-d "
                            f"Parameter (PartialFC.weight), got {type(weight).__name__}")
        if not defaults["lr"] >= 0:
            raise ValueError(f"{type(self).__name__}: lr={defaults['lr']} must be >= 0")
        if not defaults["weight_decay"] >= 0:
            raise ValueError(f"{type(self).__name__}: weight_decay={defaults['weight_decay']} "
                             "must be >= 0")
        if max_update_bytes < 1:
            raise ValueError(f"{type(self).__name__}: max_update_bytes={max_update_bytes} "
                             "must be >= 1")
        super().__init__([weight], defaults)
        self.max_update_bytes = int(max_update_bytes)
        self.dense = bool(dense)
        self._last_pop = 0  # SampledRows.pop of the last step taken

    @classmethod
    def temporaries(cls) -> int:
        """fp32 ``[rows, D]`` tensors of a chunk alive at once when each one is a copy."""
        return 2 + cls.ROW_STATE + cls.SCRATCH

    @torch.no_grad()
    def step(self, rows: SampledRows, closure=None):
        """Update the rows ``rows`` names (``head.pop_sampled_rows()`` of this step) from the
        weight's gradient. Raises on rows of another weight, and on rows not newer than those
        of the last step taken (stepping twice with one value, or with an old one)."""
        name = type(self).__name__
        if not isinstance(rows, SampledRows):
            raise TypeError(f"{name}.step: expected head.pop_sampled_rows(), got "
                            f"{type(rows).__name__}")
        if not any(rows.weight is p for group in self.param_groups for p in group["params"]):
            raise ValueError(f"{name}.step: the rows belong to another head's weight")
        if rows.pop <= self._last_pop:
            raise ValueError(f"{name}.step: stale rows (pop {rows.pop}; the last step took pop "
                             f"{self._last_pop}): pop the head's rows once per step")
        self._last_pop = rows.pop
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = None if self.dense else rows.index
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p is not rows.weight or (rows.empty and not self.dense):
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                for key, value in state.items():  # e.g. restored from another state dtype
                    if value.shape == p.shape and value.dtype != p.dtype:
                        state[key] = value.to(p.dtype)
                if index is None and self._whole(p, state, group):
                    continue
                per = rows_per_chunk(self.max_update_bytes, p[0].numel(), self.temporaries())
                total = p.shape[0] if index is None else len(index)
                grad = _GradRows(p.grad, index, per, rows.forwards == 1, rows.shared)
                for a in range(0, total, per):
                    b = min(a + per, total)
                    sel = slice(a, b) if index is None else index[a:b]
                    self._update_rows(p, state, grad.chunk(a, b, sel, per), group, sel)
        return loss

    def _update_rows(self, p: Tensor, state: dict, g: Tensor, group: dict,
                     sel: slice | Tensor) -> None:
        """``_update`` on rows ``sel`` in fp32. A slice of an fp32 tensor is updated in place
        (a view); gathered rows and narrower dtypes are copies, written back rounded once."""
        tensors = {"": p, **state}
        work = {key: t[sel].float() for key, t in tensors.items()}
        w = work.pop("")
        self._update(w, g.float(), work, group)
        work[""] = w
        for key, t in tensors.items():
            if isinstance(sel, Tensor):
                t.index_copy_(0, sel, work[key].to(t.dtype))
            elif t.dtype != torch.float32:
                t[sel] = work[key]

    def _whole(self, p: Tensor, state: dict, group: dict) -> bool:
        """Update every row of ``p`` at once, in place, where a fused kernel can; False
        leaves the step to the chunked update."""
        return False

    def _init_state(self, p: Tensor, state: dict) -> None:
        raise NotImplementedError

    def _update(self, w: Tensor, g: Tensor, state: dict, group: dict) -> None:
        """Update fp32 rows ``w`` in place from fp32 gradient ``g`` and row-sliced fp32
        ``state`` (updated in place too)."""
        raise NotImplementedError


class SampledSGD(_SampledOptimizer):
    """SGD with momentum and (coupled, L2) weight decay on the sampled rows only:
    ``d = g + wd * w; buf = momentum * buf + d; w -= lr * buf`` (``torch.optim.SGD``).

    ``fused=True``: when every row is updated from a dense gradient (``sample_rate == 1``,
    or ``dense`` with a dense gradient) and the weight and momentum are fp32, the step is
    torch's fused SGD kernel over the whole weight (``torch.optim.sgd.sgd(fused=True)``,
    the kernel behind ``torch.optim.SGD(fused=True)``): one pass reading weight, gradient
    and momentum and writing weight and momentum, no temporaries and no chunks, where the
    chunked update makes four elementwise passes per chunk (at 1M rows of 512, 128 chunks).
    The same formula in the same order: bit-identical on the CPU
    (tests/partial_fc/test_optim.py); on CUDA the kernel may contract ``momentum * buf + d``
    into one fused multiply-add (one rounding instead of two). bf16 state keeps the chunked
    update: its fp32 round trip is what this module promises (torch's CPU kernel for bf16
    does not give it)."""

    ROW_STATE, SCRATCH = 1, 1  # momentum; d

    def __init__(self, weight: Tensor, lr: float, momentum: float = 0.9,
                 weight_decay: float = 5e-4, max_update_bytes: int = 64 << 20,
                 dense: bool = False, fused: bool = True) -> None:
        if not 0 <= momentum < 1:
            raise ValueError(f"SampledSGD: momentum={momentum} must be in [0, 1)")
        super().__init__(weight, dict(lr=lr, momentum=momentum, weight_decay=weight_decay),
                         max_update_bytes, dense)
        self.fused = bool(fused)

    def _whole(self, p: Tensor, state: dict, group: dict) -> bool:
        buf = state["momentum_buffer"]
        if not (self.fused and not p.grad.is_sparse and p.dtype == buf.dtype == torch.float32
                and p.grad.dtype == torch.float32):
            return False
        sgd([p], [p.grad], [buf], fused=True, weight_decay=group["weight_decay"],
            momentum=group["momentum"], lr=group["lr"], dampening=0.0, nesterov=False,
            maximize=False)
        return True

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

    ROW_STATE, SCRATCH = 2, 2  # the moments; m * step_size and sqrt(v)

    def __init__(self, weight: Tensor, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01,
                 max_update_bytes: int = 64 << 20, dense: bool = False) -> None:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"SampledAdamW: betas={betas} must be in [0, 1)")
        if not eps > 0:
            raise ValueError(f"SampledAdamW: eps={eps} must be > 0")
        super().__init__(weight, dict(lr=lr, betas=tuple(betas), eps=eps,
                                    weight_decay=weight_decay), max_update_bytes, dense)

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
        w.addcdiv_(m * step_size, v.sqrt().div_(bias2_sqrt).add_(group["eps"]), value=-1)
