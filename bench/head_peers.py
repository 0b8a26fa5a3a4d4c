"""bench/head.py's peers: other projects' heads and fused linear cross-entropy losses.

    python bench/head.py -P 1 -N 1024 -C 50000 --steps 5 --peers torch_lce          # CPU
    python3 bench/head.py --device cuda -P 1 -N 1024 -C 1000000 --amp bf16 \
        --peers torch_lce,cce,liger --skip-textbook                                # one GPU

``textbook``: the sharded head a careful user writes with autograd; ``insightface``
(``--insightface DIR``): insightface's own ``PartialFC_V2`` with its ``CombinedMarginLoss``
(bench/head.py's docstring has both). The fused losses (``--peers``): each gets what a user of
it would hand it for a face head, ``s * normalize(e)`` and ``normalize(w)`` (both
normalisations and their backward inside the timed step, the gradient reaching the same
unnormalised rows as ours's), cast to the step's operand dtype (bf16 under ``--amp bf16``,
else fp32), and the labels. **No margin**: a plain softmax, their best case (ours and the
textbook head run ArcFace). One process only (``-P 1``): none of them shards the classes.
``r = 1`` only: none of them samples classes.

- ``torch_lce``: PyTorch's ``torch.nn.functional.linear_cross_entropy`` (torch 2.13) on its
  chunked path, ``options=torch.nn.LinearCrossEntropyOptions()`` (its ``"auto"`` chunking
  and accumulation picks per device and dtype); CPU and CUDA.
- ``cce``: Cut Cross-Entropy's ``cut_cross_entropy.linear_cross_entropy`` (PyPI
  ``cut-cross-entropy`` 25.1.1, arXiv:2411.09009) with its defaults, gradient filtering on
  (``filter_eps="high"``); CUDA only (Triton kernels).
- ``liger``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (PyPI ``liger-kernel``
  0.8.5) with its defaults; CUDA only.

Their packages are the ``bench-gpu`` optional extra (pyproject.toml), never imported by the
library; the GPU machine reaches no registry, so ``bench/peer_wheels.sh`` puts their wheels
in ``.gpu/whl``, which ``bench/gpu_session.sh`` installs. A peer that does not import (or a
torch without ``linear_cross_entropy``) is left out with one line saying why.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from partial_fc import PartialFC
from partial_fc import distributed as dist_ops
from partial_fc.sampling import local_targets

# --margin -> insightface's CombinedMarginLoss (m1, m2, m3) at our default margins
INSIGHTFACE_MARGINS = {"arcface": (1.0, 0.5, 0.0), "cosface": (1.0, 0.0, 0.35),
                       "normface": (1.0, 0.0, 0.0)}
PEERS = ("torch_lce", "cce", "liger")
CUDA_ONLY = {"cce", "liger"}
Loss = Callable[[Tensor, Tensor, Tensor], Tensor]  # (s * e_hat, w_hat, labels) -> mean loss


def _torch_lce() -> Loss:
    if not (hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")):
        raise ImportError(f"torch {torch.__version__} has no chunked "
                          "torch.nn.functional.linear_cross_entropy (torch 2.13 has)")
    options = torch.nn.LinearCrossEntropyOptions()
    return lambda e, w, y: F.linear_cross_entropy(e, w, y, options=options)


def _cce() -> Loss:
    from cut_cross_entropy import linear_cross_entropy

    return lambda e, w, y: linear_cross_entropy(e, w, y)


def _liger() -> Loss:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda e, w, y: loss(w, e, y)  # Liger's order: (lin_weight, input, target)


LOSSES: dict[str, Callable[[], Loss]] = {"torch_lce": _torch_lce, "cce": _cce, "liger": _liger}


class ShardedCrossEntropy(torch.autograd.Function):
    """The sharded softmax cross entropy as a careful autograd head writes it (Megatron's
    vocab-parallel cross entropy, insightface's ``DistCrossEntropyFunc``): the ``[N, S]``
    logits become the softmax in place and backward turns that buffer into the gradient in
    place, so one ``[N, S]`` tensor lives from the forward to the backward."""

    @staticmethod
    def forward(ctx, logits, rows, cols, group):
        row_max = logits.detach().max(dim=1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        sums = torch.zeros(2, logits.shape[0], device=logits.device)  # [sum-exp, target]
        sums[1, rows] = logits[rows, cols] - row_max[rows]
        probs = logits.sub_(row_max[:, None]).exp_()
        sums[0] = probs.sum(dim=1)
        dist.all_reduce(sums, group=group)
        probs.div_(sums[0][:, None])
        ctx.save_for_backward(probs, rows, cols)
        return (sums[0].log() - sums[1]).mean()

    @staticmethod
    def backward(ctx, grad):
        probs, rows, cols = ctx.saved_tensors
        probs[rows, cols] -= 1.0
        return probs.mul_(grad / probs.shape[0]), None, None, None


class Textbook(torch.nn.Module):
    """The sharded full-softmax head a user writes with autograd (insightface's PartialFC_V2
    structure): all-gather, normalised embeddings and rows, one ``[N, S]`` matmul, the margin
    on the target entries, the in-place sharded cross entropy above. Same shard and sampled
    rows as ours."""

    def __init__(self, ours: PartialFC):
        super().__init__()
        self.ours = ours  # reads its weight, shard, margin and last sampled rows; never runs it
        self.weight = torch.nn.Parameter(ours.weight.detach().clone())

    def forward(self, emb: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ours, group = self.ours, self.ours.process_group
        e = dist_ops.all_gather(F.normalize(emb.float(), dim=1), group)
        y = dist_ops.all_gather(labels, group)
        index = ours.sampled_index
        targets = local_targets(y, ours.class_start, ours.num_local)
        weight = self.weight
        if index is not None:  # the rows ours sampled this step, labels remapped likewise
            weight = weight[index]
            owned = targets >= 0
            targets = targets.masked_scatter(owned, torch.searchsorted(index, targets[owned]))
        s = float(ours.margin.scale.value())
        cos = (e @ F.normalize(weight, dim=1).t()).float()
        rows = (targets >= 0).nonzero().squeeze(1)
        cols = targets[rows]
        target_cos = cos[rows, cols]
        logits = cos.mul_(s)  # in place: the matmul's backward does not read its output
        logits = logits.index_put_((rows, cols), ours.margin.psi(target_cos, 0) * s)
        return ShardedCrossEntropy.apply(logits, rows, cols, group)


class Peer(nn.Module):
    """One peer as a head of bench/head.py: ``forward(emb, labels) -> loss`` on its own copy
    of ours's rows (``weight``, the same values), at ours's scale, without a margin."""

    def __init__(self, weight: Tensor, scale: float, loss: Loss):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.scale, self.loss = scale, loss

    def forward(self, emb: Tensor, labels: Tensor) -> Tensor:
        device = emb.device.type
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else torch.float32)
        e = (self.scale * F.normalize(emb.float(), dim=1)).to(dtype)
        w = F.normalize(self.weight.float(), dim=1).to(dtype)
        return self.loss(e, w, labels)


def names(text: str, device: str) -> list[str]:
    """``--peers``' comma-separated names, checked against :data:`PEERS` and the device."""
    chosen = [n for n in text.split(",") if n]
    unknown = sorted(set(chosen) - set(PEERS))
    if unknown:
        raise ValueError(f"--peers: unknown {', '.join(unknown)} (choose from {', '.join(PEERS)})")
    cuda_only = sorted(set(chosen) & CUDA_ONLY) if device != "cuda" else []
    if cuda_only:
        raise ValueError(f"--peers: {', '.join(cuda_only)} run on CUDA only (Triton kernels)")
    return chosen


def build(chosen: list[str], weight: Tensor, scale: float) -> tuple[dict[str, Peer], list[str]]:
    """The peers that import, and a line for each that does not."""
    heads, notes = {}, []
    for name in chosen:
        try:
            heads[name] = Peer(weight, scale, LOSSES[name]())
        except ImportError as err:
            hint = (" (pip install partial-fc[bench-gpu]; on the GPU machine the wheels of "
                    "bench/peer_wheels.sh)") if name in CUDA_ONLY else ""
            notes.append(f"{name}: not measured: {err}{hint}")
    return heads, notes


def insightface_head(folder: str, weight: Tensor, args, device: torch.device) -> nn.Module:
    """insightface's ``PartialFC_V2`` from the user's checkout, holding ours' rows."""
    root = Path(folder).expanduser()
    arcface_torch = root / "recognition" / "arcface_torch"
    sys.path.insert(0, str(arcface_torch if arcface_torch.is_dir() else root))
    from losses import CombinedMarginLoss
    from partial_fc_v2 import PartialFC_V2

    if device.type == "cpu":
        torch.Tensor.cuda = lambda self, *a, **k: self  # its code calls .cuda() throughout
    head = PartialFC_V2(CombinedMarginLoss(args.scale, *INSIGHTFACE_MARGINS[args.margin]),
                        args.dim, args.classes, sample_rate=args.sample_rate)
    head.weight.data = weight.detach().float().clone()
    return head.to(device)
