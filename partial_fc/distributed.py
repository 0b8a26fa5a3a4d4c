"""Differentiable collectives for the sharded head, and rank / world-size lookup.

Gradient convention (the one of Megatron-LM's tensor-parallel mappings). Every rank calls
``backward`` on the same replicated loss ``L``, and each rank's graph holds the replicated
computation plus its own partial terms. So:

- a tensor that is *replicated* (identical on all ranks) receives the complete ``dL/dx`` on
  every rank;
- a tensor that feeds only this rank's partial terms receives only that share.

Hence ``all_reduce`` (partial -> replicated) has the identity as backward, its adjoint
``copy_to_group`` (replicated -> partial) all-reduces the gradient, ``all_gather`` (row shards
-> replicated rows feeding partial terms) reduce-scatters it and ``reduce_scatter`` all-gathers
it. Each Function's backward is built from its adjoint Function, so double backward works.
Under this convention the embedding gradient is exactly ``dL/de_local``, with no world-size
factor (contrast torch.distributed.nn, whose all_reduce backward all-reduces: the gradient of
the *sum* of the ranks' losses).

Every function takes ``process_group`` (``None`` = WORLD, resolved at call time). With a world
size of 1, or no initialised process group at all, they are identities and communicate nothing.
Row counts may differ between ranks (gloo cannot gather uneven tensors, so rows are padded).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Function

__all__ = [
    "all_gather",
    "all_reduce",
    "all_reduce_max",
    "copy_to_group",
    "gather_ints",
    "gather_sizes",
    "get_rank",
    "get_world_size",
    "reduce_scatter",
]

ProcessGroup = dist.ProcessGroup | None


def _flat_all_gather(out: Tensor, x: Tensor, group: ProcessGroup) -> None:
    """``out = cat(x of every rank)``: torch 2.13 names it ``all_gather_single`` and deprecates
    ``all_gather_into_tensor``, the only name before 2.13 (our floor is 2.11)."""
    op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    op(out, x, group=group)


def _flat_reduce_scatter(out: Tensor, x: Tensor, group: ProcessGroup) -> None:
    """``out = this rank's block of sum(x of every rank)``; ``reduce_scatter_single`` from torch
    2.13 on, ``reduce_scatter_tensor`` before."""
    op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    op(out, x, op=dist.ReduceOp.SUM, group=group)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(process_group: ProcessGroup = None) -> int:
    """This process's rank in ``process_group``; 0 without an initialised process group."""
    return dist.get_rank(process_group) if _initialized() else 0


def get_world_size(process_group: ProcessGroup = None) -> int:
    """Size of ``process_group``; 1 without an initialised process group."""
    return dist.get_world_size(process_group) if _initialized() else 1


def gather_sizes(n: int, device: torch.device, process_group: ProcessGroup = None) -> list[int]:
    """Every rank's ``n`` (e.g. its local batch size), in rank order, on every rank."""
    if get_world_size(process_group) == 1:
        return [n]
    return gather_ints([n], device, process_group)[:, 0].tolist()


def gather_ints(values: Sequence[int], device: torch.device, process_group: ProcessGroup = None
                ) -> Tensor:
    """All-gather a short list of ints: ``[world, len(values)]`` int64 on every rank."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    if get_world_size(process_group) == 1:
        return mine.view(1, -1).cpu()
    out = torch.empty(get_world_size(process_group) * mine.numel(), dtype=torch.int64,
                      device=device)
    _flat_all_gather(out, mine, process_group)
    return out.view(-1, mine.numel()).cpu()


def all_reduce_max(x: Tensor, process_group: ProcessGroup = None) -> Tensor:
    """Elementwise max over ranks, **detached** (MAX has no useful adjoint; used only for the
    softmax shift, whose value cancels out of the loss)."""
    out = x.detach().clone()
    if get_world_size(process_group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=process_group)
    return out


def all_reduce(x: Tensor, process_group: ProcessGroup = None) -> Tensor:
    """Sum over ranks: partial terms -> replicated result.

    forward: all-reduce (sum); backward: identity (``copy_to_group``'s forward).
    """
    if get_world_size(process_group) == 1:
        return x
    return _AllReduce.apply(process_group, x)


def copy_to_group(x: Tensor, process_group: ProcessGroup = None) -> Tensor:
    """Replicated tensor used in per-rank partial terms.

    forward: identity; backward: all-reduce (sum) of the gradient (``all_reduce``'s forward).
    """
    if get_world_size(process_group) == 1:
        return x
    return _Copy.apply(process_group, x)


def all_gather(x: Tensor, process_group: ProcessGroup = None,
               sizes: Sequence[int] | None = None) -> Tensor:
    """Concatenate every rank's rows: ``[n_r, *]`` on rank r -> ``[sum_r n_r, *]`` everywhere.

    forward: all-gather; backward: reduce-scatter (sum over ranks, each rank keeps its rows).
    ``sizes`` (every rank's ``n_r``, see ``gather_sizes``) saves one small collective when
    known. Works for integer tensors (no gradient).
    """
    if get_world_size(process_group) == 1:
        return x
    if sizes is None:
        sizes = gather_sizes(x.shape[0], x.device, process_group)
    return _Rows.apply(process_group, tuple(sizes), True, x)


def reduce_scatter(x: Tensor, process_group: ProcessGroup = None,
                   sizes: Sequence[int] | None = None) -> Tensor:
    """Sum ``[sum_r n_r, *]`` over ranks and keep this rank's ``n_rank`` rows.

    forward: reduce-scatter; backward: all-gather. ``sizes`` defaults to equal splits.
    """
    world = get_world_size(process_group)
    if world == 1:
        return x
    if sizes is None:
        if x.shape[0] % world:
            raise ValueError(f"reduce_scatter: {x.shape[0]} rows do not split over {world} ranks")
        sizes = [x.shape[0] // world] * world
    return _Rows.apply(process_group, tuple(sizes), False, x)


# ----------------------------------------------------------------------------- pure helpers


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def _gather_rows(x: Tensor, sizes: tuple[int, ...], group: ProcessGroup) -> Tensor:
    most = max(sizes)
    out = x.new_empty((len(sizes) * most, *x.shape[1:]))
    _flat_all_gather(out, _pad_rows(x, most).contiguous(), group)
    if min(sizes) == most:
        return out
    return torch.cat([part[:n] for part, n in zip(out.split(most), sizes, strict=True)])


def _scatter_rows(x: Tensor, sizes: tuple[int, ...], group: ProcessGroup) -> Tensor:
    most = max(sizes)
    if min(sizes) != most:
        x = torch.cat([_pad_rows(part, most) for part in x.split(list(sizes))])
    out = x.new_empty((most, *x.shape[1:]))
    _flat_reduce_scatter(out, x.contiguous(), group)
    return out[: sizes[dist.get_rank(group)]]


# ----------------------------------------------------------------------------- Functions


class _AllReduce(Function):
    """forward: sum over ranks; backward: _Copy (identity)."""

    @staticmethod
    def forward(ctx, group: ProcessGroup, x: Tensor) -> Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, Tensor]:
        return None, _Copy.apply(ctx.group, grad)


class _Copy(Function):
    """forward: identity; backward: _AllReduce (sum of the ranks' partial gradients)."""

    @staticmethod
    def forward(ctx, group: ProcessGroup, x: Tensor) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, Tensor]:
        return None, _AllReduce.apply(ctx.group, grad)


class _Rows(Function):
    """forward: all-gather rows (``gather=True``) or reduce-scatter them; backward: the other
    one (each is the other's adjoint)."""

    @staticmethod
    def forward(ctx, group: ProcessGroup, sizes: tuple[int, ...], gather: bool,
                x: Tensor) -> Tensor:
        ctx.group, ctx.sizes, ctx.gather = group, sizes, gather
        return (_gather_rows if gather else _scatter_rows)(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, None, None, Tensor]:
        return None, None, None, _Rows.apply(ctx.group, ctx.sizes, not ctx.gather, grad)
