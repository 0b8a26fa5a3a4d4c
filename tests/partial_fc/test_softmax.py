"""margin_softmax_loss on one rank (no process group), from the reference class-tile statistics,
against F.cross_entropy of the full logits (float64 autograd)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from partial_fc import PartialFC, build_margin
from partial_fc.softmax import Shard, TargetTerms, margin_softmax_loss
from partial_fc.tiles import ReferenceTiles

PSIS = {
    "identity": lambda c: c,
    "cosface": lambda c: c - 0.35,
    "arcface": lambda c: torch.cos(torch.acos(c.clamp(-1 + 1e-7, 1 - 1e-7)) + 0.5),
}


def _case(seed=0, n=7, c=13, d=6):
    g = torch.Generator().manual_seed(seed)
    e = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    w = torch.randn(c, d, generator=g, dtype=torch.float64) * 0.3
    w[3] += e[0]  # sample 0's target well aligned (theta ~ 0.5 rad; not near 0 or pi, where
    # ArcFace's d/dcos ~ 1/sin(theta) amplifies fp32 rounding past these tolerances)
    labels = torch.randint(0, c, (n,), generator=g)
    labels[0] = 3
    return e, w, labels


def _reference(e, w, labels, psi, s):
    cos = e @ F.normalize(w, dim=1).t()
    rows = torch.arange(len(labels))
    logits = (cos * s).index_put((rows, labels), psi(cos[rows, labels]) * s)
    return F.cross_entropy(logits, labels), logits


def _loss(e, weight, labels, psi, s, chunk, index=None):
    w = weight.detach() if index is None else weight.detach()[index]
    inv = 1.0 / w.norm(dim=1)
    targets = labels if index is None else torch.searchsorted(index, labels)
    shard = Shard(e.detach(), w, index, inv, targets, ReferenceTiles(4 * e.shape[0] * chunk))
    row_max, row_sum, _ = shard.stats(s)
    return margin_softmax_loss(e, weight, shard, row_max, row_sum,
                               TargetTerms(lambda c, _aux: psi(c)), s)


@pytest.mark.parametrize("name", sorted(PSIS))
@pytest.mark.parametrize("tensor_scale", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 13])
def test_matches_cross_entropy_loss_grads_and_stats(name, tensor_scale, chunk):
    e64, w64, labels = _case()
    psi, s = PSIS[name], 30.0
    e_ref, w_ref = e64.clone().requires_grad_(), w64.clone().requires_grad_()
    ref, logits = _reference(e_ref, w_ref, labels, psi, s)
    ref.backward(torch.tensor(2.5, dtype=torch.float64))
    e, w = e64.float().requires_grad_(), w64.float().requires_grad_()
    scale = torch.tensor(s) if tensor_scale else s
    loss, sum_exp, shift = _loss(e, w, labels, psi, scale, chunk)
    (loss * 2.5).backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(e.grad.double(), e_ref.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=1e-4, atol=1e-5)
    logits = logits.detach()
    torch.testing.assert_close(shift.double(), logits.max(dim=1).values, rtol=1e-5, atol=1e-4)
    rows = torch.arange(len(labels))
    nontarget = torch.exp(logits - shift.double()[:, None]).index_put(
        (rows, labels), torch.zeros(len(labels), dtype=torch.float64))
    torch.testing.assert_close(sum_exp.double(), nontarget.sum(dim=1), rtol=1e-4, atol=1e-6)
    assert not sum_exp.requires_grad and not shift.requires_grad


def test_sampled_rows_get_the_gradient_and_the_others_zero():
    """With ``index`` the loss is the softmax over those rows only; the parameter's gradient
    is row-sparse: that loss's gradient on exactly those rows, nothing stored for the others."""
    e64, w64, labels = _case(seed=2, c=20)
    index = torch.unique(torch.cat([labels, torch.tensor([1, 8, 19])]))
    psi = PSIS["cosface"]
    e_ref, w_ref = e64.clone().requires_grad_(), w64.clone().requires_grad_()
    ref, _ = _reference(e_ref, w_ref[index], torch.searchsorted(index, labels), psi, 16.0)
    ref.backward()
    e, w = e64.float().requires_grad_(), w64.float().requires_grad_()
    loss, _, _ = _loss(e, w, labels, psi, 16.0, chunk=4, index=index)
    loss.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    grad = w.grad.coalesce()
    assert w.grad.is_sparse and torch.equal(grad.indices()[0], index)
    assert grad.values().shape == (len(index), w.shape[1])  # no dense [C, D] gradient
    torch.testing.assert_close(w.grad.to_dense().double(), w_ref.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.half
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
