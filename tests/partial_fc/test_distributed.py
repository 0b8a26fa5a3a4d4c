"""partial_fc.distributed: forward values and adjoint backwards of every collective.

World size 1 runs in-process with no process group; the multi-rank checks run in ONE spawned
3-rank gloo group with uneven row counts, results compared in the parent.
"""

import pytest
import torch
from spawn import run_ranks

from partial_fc import distributed as pd

SIZES = (2, 3, 1)  # rows per rank: uneven on purpose (gloo needs padding)
D = 4


def _x(rank: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, D, generator=torch.Generator().manual_seed(100 + rank))


def _w(rank: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, D, generator=torch.Generator().manual_seed(200 + rank))


def test_world_size_one_without_process_group_is_identity():
    assert not torch.distributed.is_initialized()
    assert (pd.get_rank(), pd.get_world_size()) == (0, 1)
    assert pd.gather_sizes(5, torch.device("cpu")) == [5]
    x = torch.randn(3, D, requires_grad=True)
    for fn in (pd.all_gather, pd.all_reduce, pd.copy_to_group, pd.reduce_scatter):
        y = fn(x)
        assert y is x
    assert torch.equal(pd.all_reduce_max(x), x) and not pd.all_reduce_max(x).requires_grad


NEW_NAMES = ("all_gather_single", "reduce_scatter_single")  # torch >= 2.13 only


def _collectives(rank: int, world: int, torch_before_2_13: bool) -> dict:
    if torch_before_2_13:  # this spawned worker only: the API as torch 2.11/2.12 ship it
        for name in NEW_NAMES:
            if hasattr(torch.distributed, name):
                delattr(torch.distributed, name)
    n = SIZES[rank]
    total = sum(SIZES)
    out = {"rank": pd.get_rank(), "world": pd.get_world_size(), "sizes": pd.gather_sizes(
        n, torch.device("cpu")), "new_names": [hasattr(torch.distributed, m) for m in NEW_NAMES]}
    # all_gather: forward cat, backward reduce-scatter of the ranks' partial gradients
    x = _x(rank, n).requires_grad_()
    y = pd.all_gather(x)
    (y * _w(rank, total)).sum().backward()
    out["gather"], out["gather_grad"] = y.detach(), x.grad
    # ... also with the sizes given, and for an int tensor
    out["gather_int"] = pd.all_gather(torch.full((n,), rank), sizes=SIZES)
    # all_reduce: forward sum, backward identity (loss replicated on every rank)
    x = _x(rank, 3).requires_grad_()
    y = pd.all_reduce(x)
    c = torch.arange(3 * D, dtype=torch.float32).view(3, D)
    (y * c).sum().backward()
    out["reduce"], out["reduce_grad"] = y.detach(), x.grad
    # copy_to_group: forward identity, backward sum of partial gradients
    x = torch.ones(3, D, requires_grad=True)
    (pd.copy_to_group(x) * _w(rank, 3)).sum().backward()
    out["copy_grad"] = x.grad
    # reduce_scatter: forward sum + keep own rows, backward all-gather
    x = _w(rank, total).requires_grad_()
    y = pd.reduce_scatter(x, sizes=SIZES)
    (y * _x(rank, n)).sum().backward()
    out["scatter"], out["scatter_grad"] = y.detach(), x.grad
    out["scatter_even"] = pd.reduce_scatter(torch.full((world * 2, 1), float(rank)))
    # all_reduce_max: detached
    m = pd.all_reduce_max(torch.tensor([float(rank), -float(rank)], requires_grad=True))
    out["max"], out["max_requires_grad"] = m, m.requires_grad
    # double backward through all_gather (backward built from the adjoint Function)
    x = _x(rank, n).requires_grad_()
    y = pd.all_gather(x)
    (g,) = torch.autograd.grad((y**2 * _w(rank, total)).sum(), x, create_graph=True)
    g.sum().backward()
    out["double_grad"] = x.grad
    return out


@pytest.mark.slow
@pytest.mark.parametrize("torch_before_2_13", [False, True], ids=["this-torch", "torch<2.13"])
def test_collectives_on_three_ranks(torch_before_2_13):
    world = len(SIZES)
    res = run_ranks(_collectives, world, args=(torch_before_2_13,))
    total = sum(SIZES)
    xs = [_x(r, SIZES[r]) for r in range(world)]
    w_sum = sum(_w(r, total) for r in range(world))
    starts = [sum(SIZES[:r]) for r in range(world)]
    for r, out in enumerate(res):
        rows = slice(starts[r], starts[r] + SIZES[r])
        assert (out["rank"], out["world"], out["sizes"]) == (r, world, list(SIZES))
        if torch_before_2_13:
            assert not any(out["new_names"])
        torch.testing.assert_close(out["gather"], torch.cat(xs), rtol=0, atol=0)
        torch.testing.assert_close(out["gather_grad"], w_sum[rows])
        assert out["gather_int"].tolist() == [0, 0, 1, 1, 1, 2]
        torch.testing.assert_close(out["reduce"], sum(_x(q, 3) for q in range(world)))
        torch.testing.assert_close(out["reduce_grad"],
                                   torch.arange(3 * D, dtype=torch.float32).view(3, D))
        torch.testing.assert_close(out["copy_grad"], sum(_w(q, 3) for q in range(world)))
        torch.testing.assert_close(out["scatter"], w_sum[rows])
        torch.testing.assert_close(out["scatter_grad"], torch.cat(xs))
        assert out["scatter_even"].flatten().tolist() == [3.0, 3.0]
        assert out["max"].tolist() == [2.0, 0.0] and not out["max_requires_grad"]
        torch.testing.assert_close(out["double_grad"], 2 * w_sum[rows])
