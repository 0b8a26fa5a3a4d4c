"""margin_softmax_loss on one rank (no process group) against F.cross_entropy (float64)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from partial_fc import PartialFC, build_margin
from partial_fc.softmax import margin_softmax_loss

PSIS = {
    "identity": lambda c: c,
    "cosface": lambda c: c - 0.35,
    "arcface": lambda c: torch.cos(torch.acos(c.clamp(-1 + 1e-7, 1 - 1e-7)) + 0.5),
}


def _reference(cos, labels, psi, s):
    rows = torch.arange(len(labels))
    logits = (cos * s).index_put((rows, labels), psi(cos[rows, labels]) * s)
    return F.cross_entropy(logits, labels)


@pytest.mark.parametrize("name", sorted(PSIS))
@pytest.mark.parametrize("tensor_scale", [False, True])
def test_matches_cross_entropy_loss_grad_and_stats(name, tensor_scale):
    g = torch.Generator().manual_seed(0)
    n, c, s = 7, 13, 30.0
    cos = (torch.rand(n, c, generator=g, dtype=torch.float64) * 2 - 1)
    cos[0, :] = 1.0  # saturated row: acos clamp, several maxima
    labels = torch.randint(0, c, (n,), generator=g)
    labels[0] = 3
    psi = PSIS[name]
    x_ref, x = cos.clone().requires_grad_(), cos.clone().requires_grad_()
    ref = _reference(x_ref, labels, psi, s)
    ref.backward(torch.tensor(2.5, dtype=torch.float64))
    scale = torch.tensor(s, dtype=torch.float64) if tensor_scale else s
    rows = torch.arange(n)
    loss, sum_exp, shift = margin_softmax_loss(x, rows, labels, psi, scale)
    (loss * 2.5).backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)
    assert torch.equal(x.detach(), cos)  # input untouched
    logits = (cos * s).index_put((rows, labels), psi(cos[rows, labels]) * s)
    torch.testing.assert_close(shift, logits.max(dim=1).values)
    nontarget = torch.exp(logits - shift[:, None]).index_put((rows, labels), torch.zeros(n,
                                                                 dtype=torch.float64))
    torch.testing.assert_close(sum_exp, nontarget.sum(dim=1))
    assert not sum_exp.requires_grad and not shift.requires_grad


def test_second_backward_raises_instead_of_wrong_grad():
    cos = torch.rand(4, 5, dtype=torch.float64).requires_grad_()
    rows, cols = torch.arange(4), torch.tensor([0, 1, 2, 3])
    loss, _, _ = margin_softmax_loss(cos, rows, cols, PSIS["cosface"], 10.0)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


def test_no_grad_inference_mode_and_cpu_bf16_autocast():
    g = torch.Generator().manual_seed(1)
    emb, labels = torch.randn(6, 8, generator=g), torch.randint(0, 40, (6,), generator=g)
    head = PartialFC(8, 40, build_margin(dict(type="arcface", m=0.5, s=64.0)))
    ref = head(emb, labels)
    with torch.no_grad():
        assert head(emb, labels).item() == pytest.approx(ref.item(), rel=1e-6)
    with torch.inference_mode():
        assert head(emb, labels).item() == pytest.approx(ref.item(), rel=1e-6)
    x = emb.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = head(x, labels)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(x.grad).all()
    assert math.isfinite(head.stats["b_avg"])
