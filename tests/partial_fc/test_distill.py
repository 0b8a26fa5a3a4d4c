"""partial_fc.distill: each loss is its formula on one process, and 2 gloo ranks holding
halves of the batch get the 1-process loss and gradients (the similarity loss included,
whose pairs cross ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from spawn import run_ranks

from partial_fc.distill import DISTILL_LOSSES, cosine_summary, distill_loss

N, D = 6, 5


def _batch(d_teacher: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(N, D, generator=gen), torch.randn(N, d_teacher, generator=gen)


def _formula(kind: str, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if kind == "cosine":
        return (1 - F.cosine_similarity(s, t)).mean()
    if kind == "l2":
        return ((s - t) ** 2).sum(1).mean()
    gs, gt = F.normalize(s) @ F.normalize(s).T, F.normalize(t) @ F.normalize(t).T
    return ((gs - gt) ** 2).mean()


@pytest.mark.parametrize("kind", DISTILL_LOSSES)
def test_one_process_is_the_formula(kind):
    s, t = _batch()
    assert torch.allclose(distill_loss(kind, s, t, [N]), _formula(kind, s, t), atol=1e-6)


def test_similarity_takes_another_teacher_width_and_cosine_refuses_nothing_silently():
    s, t = _batch(d_teacher=3)
    assert torch.allclose(distill_loss("similarity", s, t, [N]), _formula("similarity", s, t))
    assert cosine_summary(s, t, [N]) == {}
    with pytest.raises(ValueError, match="'kl'"):
        distill_loss("kl", s, t, [N])


def _two_ranks(rank, world_size):
    s_all, t_all = _batch()
    rows = slice(rank * N // 2, (rank + 1) * N // 2)
    out = {}
    for kind in DISTILL_LOSSES:
        s = s_all[rows].clone().requires_grad_()
        loss = distill_loss(kind, s, t_all[rows], [N // 2] * 2)
        loss.backward()
        out[kind] = (loss.detach().clone(), s.grad.clone())
    out["summary"] = {k: v.clone() for k, v in cosine_summary(s_all[rows], t_all[rows],
                                                              [N // 2] * 2).items()}
    return out


@pytest.mark.slow
def test_two_ranks_equal_one_process():
    results = run_ranks(_two_ranks, world_size=2)
    s_all, t_all = _batch()
    for kind in DISTILL_LOSSES:
        s = s_all.clone().requires_grad_()
        want = distill_loss(kind, s, t_all, [N])
        want.backward()
        for rank, got in enumerate(results):
            loss, grad = got[kind]
            assert torch.allclose(loss, want.detach(), atol=1e-6), kind
            assert torch.allclose(grad, s.grad[rank * N // 2:(rank + 1) * N // 2],
                                  atol=1e-6), kind
    cos = F.cosine_similarity(s_all, t_all)
    for got in results:
        assert torch.allclose(got["summary"]["mean"], cos.mean())
        assert torch.allclose(got["summary"]["p50"], cos.quantile(0.5))
