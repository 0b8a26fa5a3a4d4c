"""``margin.gradient``: exact (autograd's derivative of psi) or straight_through (insightface
arcface_torch's: the margin applied under ``torch.no_grad``, so ``d psi / d cos = 1``).

The reference is written here as arcface_torch's ``CombinedMarginLoss`` writes it: the
clamped cosine logits, the angular margin put in place under ``no_grad``, times ``s``, then the
mean cross-entropy; both of the head's tile back-ends (torch, and Triton in its interpreter on
CPU) must give its gradients.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from partial_fc import PartialFC, build_margin
from partial_fc.margins.registry import margin_errors
from partial_fc.margins.step import MarginBatch

if not torch.cuda.is_available():  # must precede the first import of triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

N, C, D, S = 12, 30, 16, 64.0
MARGINS = {
    "arcface": (dict(type="arcface", m=0.5), lambda th: torch.cos(th + 0.5)),
    "combined": (dict(type="combined", m1=1.1, m2=0.2, m3=0.1),
                 lambda th: torch.cos(1.1 * th + 0.2) - 0.1),
    # A-Softmax, m = 2 (arXiv:1704.08063): (-1)^k cos(2 theta) - 2k, k = floor(2 theta / pi)
    "sphereface": (dict(type="sphereface", m=2, lambda_base=0.0),
                   lambda th: torch.where(th <= torch.pi / 2, torch.cos(2 * th),
                                          -torch.cos(2 * th) - 2.0)),
}


def _kernels() -> list[str]:
    from partial_fc.tiles import triton_available
    return ["torch", "triton"] if triton_available() else ["torch"]


def _inputs():
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(N, D, generator=g)
    labels = torch.randint(0, C, (N,), generator=g)
    return emb, labels


def _arcface_torch_grads(emb, weight, labels, psi_of_theta):
    """Gradients as arcface_torch computes them (partial_fc_v2.py + losses.py, one rank)."""
    e = emb.clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logits = F.linear(F.normalize(e), F.normalize(w)).clamp(-1, 1)
    rows = torch.arange(len(labels))
    target_logit = logits[rows, labels]
    with torch.no_grad():  # CombinedMarginLoss: in place, invisible to autograd
        target_logit.arccos_()
        logits.arccos_().cos_()
        logits[rows, labels] = psi_of_theta(target_logit)
    F.cross_entropy(logits * S, labels).backward()
    return e.grad, w.grad


def _ours(cfg, kernel, emb, labels):
    head = PartialFC(D, C, build_margin(cfg), seed=3, kernel=kernel)
    e = emb.clone().requires_grad_()
    head(e, labels).backward()
    return head, e.grad, head.weight.grad


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize("name", sorted(MARGINS))
def test_straight_through_is_arcface_torchs_gradient(name, kernel):
    cfg, psi = MARGINS[name]
    emb, labels = _inputs()
    head, g_e, g_w = _ours({**cfg, "gradient": "straight_through"}, kernel, emb, labels)
    want_e, want_w = _arcface_torch_grads(emb, head.weight, labels, psi)
    torch.testing.assert_close(g_e, want_e, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(g_w, want_w, rtol=1e-4, atol=1e-6)
    # The exact gradient is a different one (the test could fail), with the same loss.
    head_x, x_e, _ = _ours({**cfg, "gradient": "exact"}, kernel, emb, labels)
    assert (x_e - want_e).norm() > 0.01 * want_e.norm()
    assert head_x.stats["loss"] == pytest.approx(head.stats["loss"], rel=1e-6)


def test_straight_through_keeps_the_forward_and_the_warmup_blend():
    exact = build_margin(dict(type="arcface", m=0.5, warmup_steps=4))
    st = build_margin(dict(type="arcface", m=0.5, warmup_steps=4, gradient="straight_through"))
    c = torch.linspace(-0.8, 0.9, 9, requires_grad=True)
    batch = MarginBatch(c.detach(), None, slice(0, 9), 2, 0, True)  # after 2 of 4 steps
    assert torch.equal(st.begin(batch).psi(c, None), exact.begin(batch).psi(c, None))
    st.begin(batch).psi(c, None).sum().backward()
    assert torch.equal(c.grad, torch.ones_like(c))


def test_cosface_gradient_is_the_same_either_way():
    emb, labels = _inputs()
    _, a, wa = _ours(dict(type="cosface", m=0.35), "torch", emb, labels)
    _, b, wb = _ours(dict(type="cosface", m=0.35, gradient="straight_through"), "torch", emb,
                     labels)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    torch.testing.assert_close(wa, wb, rtol=1e-6, atol=0)


def test_an_unknown_gradient_is_named():
    errors = margin_errors(dict(type="arcface", gradient="detached"))
    assert errors == [("margin.gradient",
                       "margin.gradient='detached': not one of exact|straight_through")]
    with pytest.raises(ValueError, match="margin.gradient='detached'"):
        build_margin(dict(type="arcface", gradient="detached"))
