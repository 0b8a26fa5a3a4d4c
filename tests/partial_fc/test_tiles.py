"""The class-tile back-ends (partial_fc.tiles: Triton kernels, PyTorch reference) against float64.

Without CUDA the kernels run in triton's interpreter (``TRITON_INTERPRET=1``, set here before
triton is imported) on CPU tensors, at small odd sizes that exercise every mask, several class
splits and the split combine; with CUDA the same cases run compiled, plus medium sizes.

Tolerances are first-order rounding bounds, doubled, evaluated componentwise from the float64
reference (``u = 2**-24``; the reference uses the operands rounded to the kernels' dot dtype, so
only the kernels' own roundings count):
- a cosine: a D-term fp32 dot then one product with ``inv_norm``: ``|d cos| <= (D + 2) u``
  (``sum_d |e_d w_d| inv <= ||e|| <= 1.01``; Higham's gamma_n bound);
- ``s cos``, hence the row max: ``s (D + 3) u``; each ``exp`` term of the row sum: relative
  ``2 s (D + 3) u`` (its exponent and the max) ``+ (2 s + 8) u`` (subtraction, exp) ``+ S u``
  (the summation);
- ``dL/dcos``: relative ``s (D + 3) u + (|s cos| + |lse| + 4) u``, plus the unit roundoff of
  the dot dtype (``2**-8`` bf16, ``2**-11`` fp16) when rounded for the backward matmuls;
  a gradient entry ``sum_k G_k x_k``: that relative error ``+ (K + 4) u`` times
  ``sum_k |G_k x_k|`` (K terms); fp16 also underflows: ``+ 2**-25 sum_k |x_k|``; ``grad_w`` of
  a 16-bit ``w`` is in ``w``'s dtype: ``+`` its unit roundoff times ``|grad_w|``.
For fp32 at s=64, D=64 the row-sum bound is ~1e-3 relative (worst case; the observed errors
are ~1e-6); gradient bounds come to <= 1e-3 (fp32) and ~3e-2 (16-bit operands) of the largest
gradient entry, which each test also asserts (so a bound cannot silently become vacuous).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys

import pytest
import torch

from partial_fc.tiles import ReferenceTiles

CUDA = torch.cuda.is_available()
if not CUDA:  # must precede the first import of triton (triton.jit reads it at decoration)
    os.environ.setdefault("TRITON_INTERPRET", "1")
tm = pytest.importorskip("partial_fc.tiles.triton",
                         reason="triton is not installed (pip install triton)")

DEVICE = torch.device("cuda" if CUDA else "cpu")


def _seven_columns(n: int) -> ReferenceTiles:
    """The reference back-end sweeping 7 columns at a time for ``n`` rows."""
    return ReferenceTiles(4 * n * 7)
U = 2.0**-24
OP_ROUNDOFF = {torch.float32: U, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FP16_UNDERFLOW = 2.0**-25  # half fp16's subnormal spacing: dL/dcos below ~6e-8 rounds to 0


def _inputs(n, s_cols, d, e_dtype, w_dtype, targets, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    w = torch.randn(s_cols, d, generator=g, dtype=torch.float64) * 0.05
    w[:3] *= 7.0  # rows of very different norms: inv_norm must be applied per column
    if targets == "all":
        tgt = torch.randint(0, s_cols, (n,), generator=g)
    elif targets == "none":
        tgt = torch.full((n,), -1)
    else:
        tgt = torch.randint(-1, s_cols, (n,), generator=g)
    e, w = e.to(e_dtype), w.to(w_dtype)
    inv = 1.0 / w.double().norm(dim=1)
    return [t.to(DEVICE) for t in (e, w, inv.float(), tgt)]


def _backward_inputs(n, s_cols, tgt, logits_lse, seed=1):
    """``lse`` = the rows' own log-sum-exp plus other ranks' mass; random-sign ``coef`` and
    ``target_grad``, the latter huge where ``target_col = -1`` (it must not be read there)."""
    g = torch.Generator().manual_seed(seed)
    other = torch.randn(n, generator=g, dtype=torch.float64).to(DEVICE)
    lse = torch.logaddexp(logits_lse, other)
    coef = torch.randn(n, generator=g).to(DEVICE)
    tgrad = torch.randn(n, generator=g).to(DEVICE)
    tgrad = torch.where(tgt >= 0, tgrad, torch.full_like(tgrad, 1e30))
    return lse.float(), coef, tgrad


def _op_dtype(e, w):
    return w.dtype if e.dtype == torch.float32 else e.dtype


def _reference(e, w, inv, tgt, s):
    """float64 cosines of the operands as the kernels' dots see them, and the non-target mask."""
    op = _op_dtype(e, w)
    e_op, w_op = e.to(op).double(), w.to(op).double()
    cos = (e_op @ w_op.T) * inv.double()
    keep = torch.ones_like(cos, dtype=torch.bool)
    here = (tgt >= 0).nonzero().squeeze(1)
    keep[here, tgt[here]] = False
    return e_op, w_op, cos, keep


def _reference_stats(cos, keep, s):
    z = torch.where(keep, s * cos, -torch.inf)
    row_max = z.amax(dim=1)
    shift = torch.where(torch.isinf(row_max), 0.0, row_max)
    return row_max, torch.exp(z - shift[:, None]).sum(dim=1), torch.where(keep, cos, 0.0).sum(1)


def _dcos(cos, keep, tgt, s, lse, coef, tgrad):
    grad = torch.where(keep, coef.double()[:, None] * torch.exp(s * cos - lse.double()[:, None]),
                       0.0)
    here = (tgt >= 0).nonzero().squeeze(1)
    grad[here, tgt[here]] = tgrad.double()[here]
    return grad


def _assert_within(name, got, want, bound, dtype=torch.float32):
    """``|got - want| <= bound`` elementwise; NaN (a poisoned, unwritten output) fails."""
    assert got.shape == want.shape and got.dtype == dtype, (name, got.shape, got.dtype)
    err = (got.double() - want).abs()
    ok = err <= bound
    ok |= torch.isinf(want) & (got.double() == want)
    where = (~ok).nonzero()[:3].tolist()
    assert bool(ok.all()), (f"{name}: max excess {float((err - bound)[~ok].max()):.3g}, "
                            f"max error {float(err[~ok].max()):.3g} at {where}")


@pytest.fixture
def poisoned(monkeypatch):
    """Every ``torch.empty`` during the test is NaN-filled (ints: -7), so an output element or
    partial that a kernel never writes fails the comparison instead of reading as 0."""
    real = torch.empty

    def empty(*size, **kwargs):
        out = real(*size, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", empty)


CASES = {  # N, S, D, e dtype, w dtype, s, targets: small, odd, every mask, several class splits,
    # K splits and backward chunks (the interpreter's chunk is 8 KiB of G': 48 columns at N=33 fp32)
    "one-tile-fp32": (8, 5, 16, torch.float32, torch.float32, 1.0, "mixed"),
    "odd-fp32-s64": (33, 70, 40, torch.float32, torch.float32, 64.0, "mixed"),
    "bf16-all-targets": (17, 37, 64, torch.bfloat16, torch.bfloat16, 64.0, "all"),
    "fp32-e-bf16-w-no-targets": (20, 48, 24, torch.float32, torch.bfloat16, 1.0, "none"),
    "fp16-odd-d": (9, 33, 19, torch.float16, torch.float16, 30.0, "mixed"),
    "one-class-is-the-target": (9, 1, 16, torch.float32, torch.float32, 64.0, "all"),
    "bf16-two-chunks": (40, 150, 32, torch.bfloat16, torch.bfloat16, 64.0, "mixed"),
}
MEDIUM = {  # compiled only: the CUDA tile sizes, many splits, D = 512 as in training
    "bf16-d512": (300, 5000, 512, torch.bfloat16, torch.bfloat16, 64.0, "mixed"),
    "fp32-e-bf16-w-d512": (1024, 2100, 512, torch.float32, torch.bfloat16, 64.0, "mixed"),
    "fp32-odd": (130, 3001, 136, torch.float32, torch.float32, 64.0, "mixed"),
}


def _stats_bounds(e_op, w_op, inv, cos, keep, s, d):
    mag = (e_op.abs() @ w_op.abs().T) * inv.double()  # sum_d |e_d w_d| inv
    eps = (d + 2) * U * mag + U * cos.abs()  # |d cos|
    eps_max = torch.where(keep, eps, 0.0).amax(dim=1)
    max_bound = 2 * s * (eps_max + U)
    rel_sum = 2 * (2 * s * eps_max + (2 * s + 8 + keep.shape[1]) * U)
    cos_bound = 2 * (torch.where(keep, eps + keep.shape[1] * U * cos.abs(), 0.0).sum(1))
    return max_bound, rel_sum, cos_bound


def _check_stats(n, s_cols, d, e_dtype, w_dtype, s, targets, tensor_scale=False,
                 stats=None):
    """``stats`` (default: the kernels' ``class_tile_stats``) within the float64 bounds."""
    e, w, inv, tgt = _inputs(n, s_cols, d, e_dtype, w_dtype, targets)
    before = [t.clone() for t in (e, w, inv, tgt)]
    scale = torch.tensor(s, device=DEVICE) if tensor_scale else s  # AdaCos passes a 0-d tensor
    row_max, row_sum, cos_sum = (stats or tm.class_tile_stats)(e, w, inv, tgt, scale)
    e_op, w_op, cos, keep = _reference(e, w, inv, tgt, s)
    want_max, want_sum, want_cos = _reference_stats(cos, keep, s)
    max_bound, rel_sum, cos_bound = _stats_bounds(e_op, w_op, inv, cos, keep, s, d)
    _assert_within("row_max", row_max, want_max, max_bound)
    _assert_within("row_sum", row_sum, want_sum, rel_sum * want_sum)
    _assert_within("cos_sum", cos_sum, want_cos, cos_bound)
    assert all(torch.equal(a, b) for a, b in zip(before, (e, w, inv, tgt), strict=True))
    if s_cols == 1 and targets == "all":  # no non-target column at all
        assert torch.isneginf(row_max).all() and (row_sum == 0).all() and (cos_sum == 0).all()


def _check_grads(n, s_cols, d, e_dtype, w_dtype, s, targets, grads=None):
    """``grads`` (default: the kernels' ``class_tile_grads``) within the float64 bounds."""
    e, w, inv, tgt = _inputs(n, s_cols, d, e_dtype, w_dtype, targets)
    e_op, w_op, cos, keep = _reference(e, w, inv, tgt, s)
    logits = torch.where(keep, s * cos, 0.8 * s * cos)  # a margin-lowered target logit
    lse, coef, tgrad = _backward_inputs(n, s_cols, tgt, torch.logsumexp(logits, dim=1))
    before = [t.clone() for t in (e, w, inv, tgt, lse, coef, tgrad)]
    grad_e, grad_w = (grads or tm.class_tile_grads)(e, w, inv, tgt, s, lse, coef, tgrad)
    assert all(torch.equal(a, b) for a, b in zip(before, (e, w, inv, tgt, lse, coef, tgrad),
                                                 strict=True))
    g = _dcos(cos, keep, tgt, s, lse, coef, tgrad)
    inv64 = inv.double()
    w_hat_op = w_op * inv64[:, None]  # what the dots multiply
    w_hat = w.double() * inv64[:, None]  # what the chain rule projects on (w as stored)
    want_e = g @ w_hat_op
    g_w = g.T @ e_op
    want_w = inv64[:, None] * (g_w - w_hat * (w_hat * g_w).sum(1, keepdim=True))  # spec formula

    mag = (e_op.abs() @ w_op.abs().T) * inv64
    rel = (s * (d + 3) * U * mag + (s * cos.abs() + lse.double().abs()[:, None] + 4) * U
           + OP_ROUNDOFF[_op_dtype(e, w)])  # per entry of dL/dcos, as the dots see it
    bound_e = 2 * ((g.abs() * rel) @ w_hat_op.abs() + (s_cols + 4) * U * g.abs() @ w_hat_op.abs())
    err_g = 2 * ((g.abs() * rel).T @ e_op.abs() + (n + 4) * U * g.abs().T @ e_op.abs())
    if _op_dtype(e, w) == torch.float16:  # absolute error of each rounded dL/dcos
        bound_e += 2 * FP16_UNDERFLOW * w_op.abs().sum(0)  # the dot rounds G inv, times w
        err_g += 2 * FP16_UNDERFLOW * e_op.abs().sum(0)
    radial = (w_hat * g_w).sum(1, keepdim=True)
    # an error of g through inv (I - w_hat w_hat^T), plus the epilogue's own roundings
    bound_w = inv64[:, None] * (err_g + w_hat.abs() * (w_hat.abs() * err_g).sum(1, keepdim=True)
                                + 4 * U * (g_w.abs() + w_hat.abs() * radial.abs()))
    if w_dtype != torch.float32:  # grad_w in w's dtype: the fp32 result rounded to nearest
        bound_w += 2 * OP_ROUNDOFF[w_dtype] * want_w.abs()
    _assert_within("grad_e", grad_e, want_e, bound_e)
    _assert_within("grad_w", grad_w, want_w, bound_w, dtype=w_dtype)
    # The bounds are not vacuous: worst cases seen 1e-3 (fp32, s=64) and 3e-2 (16-bit).
    limit = 0.05 if e_dtype != torch.float32 or w_dtype != torch.float32 else 0.01
    assert float(bound_e.max()) < limit * float(want_e.abs().max())
    assert float(bound_w.max()) < limit * float(want_w.abs().max())


@pytest.mark.half
@pytest.mark.parametrize("case", sorted(CASES))
def test_class_tile_stats_match_float64(case, poisoned):
    _check_stats(*CASES[case], tensor_scale=case.startswith("odd"))


@pytest.mark.half
@pytest.mark.parametrize("case", sorted(CASES))
def test_class_tile_grads_match_float64(case, poisoned):
    _check_grads(*CASES[case])


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_tiles_match_float64(case, poisoned):
    """The PyTorch reference (``partial_fc.tiles.reference``, chunk = 7 columns: several
    chunks, a partial last one) within the same bounds as the kernels."""
    ref = _seven_columns(CASES[case][0])
    _check_stats(*CASES[case], tensor_scale=case.startswith("odd"),
                 stats=ref.class_tile_stats)
    _check_grads(*CASES[case], grads=ref.class_tile_grads)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (compiled Triton kernels)")
@pytest.mark.parametrize("case", sorted(MEDIUM))
def test_compiled_kernels_match_float64_at_medium_sizes(case, poisoned):
    _check_stats(*MEDIUM[case], tensor_scale=True)
    _check_grads(*MEDIUM[case])
    ref = _seven_columns(MEDIUM[case][0])
    _check_stats(*MEDIUM[case], tensor_scale=True, stats=ref.class_tile_stats)
    _check_grads(*MEDIUM[case], grads=ref.class_tile_grads)


@pytest.mark.half
@pytest.mark.parametrize("grads", [tm.class_tile_grads, _seven_columns(40).class_tile_grads],
                         ids=["triton", "torch"])
def test_bf16_weight_gradient_is_the_fp32_one_rounded_once(grads):
    """A bf16 ``w`` (the head's ``state_dtype=bf16``) gets its gradient in bf16: the fp32
    result for the same bf16 operands (``w`` widened, exact) rounded to nearest once, and the
    same ``grad_e``; the interpreter's truncating cast must not show (``_operand``)."""
    e, w, inv, tgt = _inputs(40, 150, 32, torch.bfloat16, torch.bfloat16, "mixed")
    _, _, cos, keep = _reference(e, w, inv, tgt, 64.0)
    lse, coef, tgrad = _backward_inputs(40, 150, tgt, torch.logsumexp(64.0 * cos, dim=1))
    grad_e, grad_w = grads(e, w, inv, tgt, 64.0, lse, coef, tgrad)
    want_e, want_w = grads(e, w.float(), inv, tgt, 64.0, lse, coef, tgrad)
    assert grad_w.dtype == torch.bfloat16 and want_w.dtype == torch.float32
    assert torch.equal(grad_e, want_e) and torch.equal(grad_w, want_w.bfloat16())


def test_kernels_compose_into_autograds_margin_softmax_gradients():
    """Used as the head uses them (one rank, CosFace ``psi(c) = c - m``, arXiv:1801.09414
    Eq. 4), the two functions give autograd's gradients of the mean cross-entropy w.r.t. the
    normalised embeddings and the *unnormalised* weight rows (float64 reference, fp32 kernels).
    """
    n, s_cols, d, s, m = 12, 40, 24, 30.0, 0.35
    g = torch.Generator().manual_seed(3)
    e = torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    w = torch.randn(s_cols, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, s_cols, (n,), generator=g)
    rows = torch.arange(n)
    e_ref, w_ref = e.clone().requires_grad_(), w.clone().requires_grad_()
    cos = e_ref @ torch.nn.functional.normalize(w_ref, dim=1).T
    logits = (s * cos).index_put((rows, y), s * (cos[rows, y] - m))
    torch.nn.functional.cross_entropy(logits, y).backward()

    e32, w32, y = e.float().to(DEVICE), w.float().to(DEVICE), y.to(DEVICE)
    inv = (1.0 / w.norm(dim=1)).float().to(DEVICE)
    row_max, row_sum, _ = tm.class_tile_stats(e32, w32, inv, y, s)
    target_logit = s * ((e32 * w32[y]).sum(1) * inv[y] - m)
    lse = torch.logaddexp(row_max + torch.log(row_sum), target_logit)
    coef = torch.full((n,), s / n, device=DEVICE)  # dL/dcos_ik = s p_ik / N off target
    target_grad = s * (torch.exp(target_logit - lse) - 1.0) / n  # psi' = 1
    grad_e, grad_w = tm.class_tile_grads(e32, w32, inv, y, s, lse, coef, target_grad)
    torch.testing.assert_close(grad_e.cpu().double(), e_ref.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad_w.cpu().double(), w_ref.grad, rtol=1e-4, atol=1e-6)


def _near_the_poles(n=21, s_cols=45, d=24, seed=4):
    """fp32 inputs whose non-target cosines reach past AdaFace's band ``[-1 + 1e-3, 1 - 1e-3]``:
    rows of ``w`` that are (scaled) copies of an embedding (cos 1), of its negation (cos -1),
    and slightly tilted copies (cos about 0.9999 and 0.998: just outside and inside), among
    random ones, for the first 7 embeddings; the others are those 7 slightly moved (each
    row has columns past the band); the targets elsewhere, so these are non-targets."""
    g = torch.Generator().manual_seed(seed)
    e = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)
    w = torch.randn(s_cols, d, generator=g) * 0.05
    for k, (i, tilt) in enumerate([(0, 0.0), (1, 0.0), (2, 0.014), (3, 0.06), (4, 0.0145)]):
        noise = torch.randn(d, generator=g)
        noise -= (noise @ e[i]) * e[i]  # perpendicular: cos = 1 / sqrt(1 + tilt^2)
        w[k] = (e[i] + tilt * torch.nn.functional.normalize(noise, dim=0)) * (1.5 + k)
    w[5], w[6] = -e[5] * 0.3, -e[6] * 2.0
    e[7:] = torch.nn.functional.normalize(e[torch.arange(7, n) % 7]
                                          + 1e-3 * torch.randn(n - 7, d, generator=g), dim=1)
    tgt = torch.randint(7, s_cols, (n,), generator=g)
    tgt[::4] = -1
    inv = 1.0 / w.double().norm(dim=1)
    return [t.to(DEVICE) for t in (e, w, inv.float(), tgt)]


def test_the_kernels_clamp_nontarget_cosines_as_the_reference():
    """AdaFace's non-target clamp (``NonTarget(clamp=1e-3)``, its authors' ``head.py``) in the
    kernels equals the torch path on cosines past both ends of the band: the softmax sees the
    clamped cosine, the gradient is 0 past the band, ``cos_sum`` stays the raw sum."""
    from partial_fc.nontarget import NonTarget

    e, w, inv, tgt = _near_the_poles()
    clamp, s, ref = NonTarget(clamp=1e-3), 64.0, _seven_columns(e.shape[0])
    raw = (e @ w.T) * inv
    beyond = ((raw > 1 - 1e-3) | (raw < -1 + 1e-3)).sum().item()
    assert beyond >= e.shape[0] // 2 and (raw < -1 + 1e-3).any()  # the case is exercised
    got = tm.class_tile_stats(e, w, inv, tgt, s, nontarget=clamp)
    want = ref.class_tile_stats(e, w, inv, tgt, s, nontarget=clamp)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)
    plain = tm.class_tile_stats(e, w, inv, tgt, s)  # the clamp changes the statistics
    assert (plain[0] - got[0]).abs().max() > 0.03 and torch.equal(plain[2], got[2])
    lse = torch.logaddexp(want[0] + torch.log(want[1]), torch.zeros_like(want[0]))
    coef = torch.full_like(lse, s / e.shape[0])
    tgrad = torch.where(tgt >= 0, -coef, 0.0)
    got = tm.class_tile_grads(e, w, inv, tgt, s, lse, coef, tgrad, nontarget=clamp)
    want = ref.class_tile_grads(e, w, inv, tgt, s, lse, coef, tgrad, nontarget=clamp)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    plain = tm.class_tile_grads(e, w, inv, tgt, s, lse, coef, tgrad)  # slope 1 past the band
    assert (plain[0] - got[0]).abs().max() > 0.1 * got[0].abs().max()
    with pytest.raises(ValueError, match=r"eps in \(0, 1\)"):
        tm.class_tile_stats(e, w, inv, tgt, s, nontarget=NonTarget(clamp=1.0))


def _hard_negatives(n=13, s_cols=37, d=24, seed=5):
    """fp32 inputs where 3-32 % of each row's cosines lie above 0.2 (10 % of all above 0.3):
    rows of ``w`` near the first embeddings, 5 of them scaled, among random ones (3 class
    splits of the interpreter's 16-column tiles); a third of the rows own no target."""
    g = torch.Generator().manual_seed(seed)
    e = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)
    w = torch.randn(s_cols, d, generator=g) * 0.3
    w[:n] += e * torch.linspace(0.5, 3.0, n)[:, None]
    w[:5] *= 4.0
    tgt = torch.randint(0, s_cols, (n,), generator=g)
    tgt[::3] = -1
    inv = 1.0 / w.double().norm(dim=1)
    return [t.to(DEVICE) for t in (e, w, inv.float(), tgt)], g


TRANSFORMS = {  # each non-target transform the kernels take (partial_fc.nontarget), alone and
    # as a head combines them: the filter with any margin, CurricularFace's modulation
    "filter": dict(tau=0.3),
    "clamp-filter": dict(clamp=1e-3, tau=0.3),
    "curricular": dict(curricular=True),
    "curricular-filter": dict(tau=0.3, curricular=True),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_the_kernels_filter_and_modulate_nontarget_cosines_as_the_reference(name):
    """The inter-class filter (``f = 0`` above ``tau``, arcface_torch) and CurricularFace's
    modulation (``f = c (t + c)`` above each row's ``cos(theta_y + m)``, arXiv:2004.00288
    Eq. 6-7; ``f' = t + 2c``) in the kernels equal the torch path: the statistics, each row's
    hard-negative count (added to ``hard_rows``), ``grad_e`` and ``grad_w``. The plain
    kernels differ by far on the same case, so a dropped transform fails here."""
    from partial_fc.nontarget import NonTarget

    (e, w, inv, tgt), g = _hard_negatives()
    n, s, ref = e.shape[0], 32.0, _seven_columns(e.shape[0])
    spec = dict(TRANSFORMS[name])
    if spec.pop("curricular", False):  # thresholds spread around the cosines' upper third
        spec.update(hard_above=(0.1 + 0.2 * torch.rand(n, generator=g)).to(DEVICE),
                    t=torch.tensor(0.3, device=DEVICE))
    step = NonTarget(**spec)
    raw = (e @ w.T) * inv
    assert (raw > 0.3).sum() >= n and (raw < 0.3).sum() >= n  # the case is exercised
    counted = {}
    for key, tiles in (("got", tm), ("want", ref)):
        rows = torch.zeros(n, device=DEVICE) if step.hard_above is not None else None
        counted[key] = (tiles.class_tile_stats(e, w, inv, tgt, s, nontarget=dataclasses.replace(
            step, hard_rows=rows)), rows)
    (got, got_rows), (want, want_rows) = counted["got"], counted["want"]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    if step.hard_above is not None:
        assert torch.equal(got_rows, want_rows) and want_rows.sum() >= n
    plain = tm.class_tile_stats(e, w, inv, tgt, s)
    assert (plain[0] - got[0]).abs().max() > 0.5 and torch.equal(plain[2], got[2])
    lse = torch.logaddexp(want[0] + torch.log(want[1]), torch.zeros_like(want[0]))
    coef = torch.full_like(lse, s / n)
    tgrad = torch.where(tgt >= 0, -coef, 0.0)
    got = tm.class_tile_grads(e, w, inv, tgt, s, lse, coef, tgrad, nontarget=step)
    want = ref.class_tile_grads(e, w, inv, tgt, s, lse, coef, tgrad, nontarget=step)
    plain = tm.class_tile_grads(e, w, inv, tgt, s, lse, coef, tgrad)
    for a, b, p in zip(got, want, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
        assert (p - b).abs().max() > 0.1 * b.abs().max()


def test_every_launch_states_fp_fusion(monkeypatch):
    """Each kernel launch passes Triton the tiles' options with ``enable_fp_fusion`` set
    (``tm.FP_FUSION``): left unset, the kernels' rounding would change with Triton 3.10's new
    default, and 3.9 warns at every compile. Recorded at the launch seam (the interpreter
    drops compile options; ``test_kernels_aot.py`` compiles with them)."""
    launched = []
    for kernel in (tm._stats_kernel, tm._dcos_kernel, tm._gemm_kernel):
        def spy(*args, kernel=kernel, run=kernel.run, **kwargs):
            launched.append((kernel, kwargs.get("enable_fp_fusion"), kwargs.get("num_warps")))
            return run(*args, **kwargs)
        monkeypatch.setattr(kernel, "run", spy)
    e, w, inv, tgt = _inputs(5, 9, 16, torch.float32, torch.float32, "mixed")
    row_max, row_sum, _ = tm.class_tile_stats(e, w, inv, tgt, 8.0)
    lse, coef, tgrad = _backward_inputs(5, 9, tgt, torch.log(row_sum) + row_max)
    tm.class_tile_grads(e, w, inv, tgt, 8.0, lse, coef, tgrad)
    assert {k for k, *_ in launched} == {tm._stats_kernel, tm._dcos_kernel, tm._gemm_kernel}
    assert all(fusion is tm.FP_FUSION and warps for _, fusion, warps in launched), launched


def test_rejects_mismatched_inputs():
    e, w, inv, tgt = _inputs(8, 5, 16, torch.float32, torch.float32, "mixed")
    with pytest.raises(ValueError, match="same D"):
        tm.class_tile_stats(e, w[:, :8], inv, tgt, 1.0)
    with pytest.raises(ValueError, match="target_col"):
        tm.class_tile_stats(e, w, inv, tgt.int(), 1.0)
    with pytest.raises(ValueError, match="mix bfloat16 and float16"):
        tm.class_tile_stats(e.bfloat16(), w.half(), inv, tgt, 1.0)
    with pytest.raises(ValueError, match="empty input"):
        tm.class_tile_stats(e, w[:0], inv[:0], tgt, 1.0)
    with pytest.raises(ValueError, match="lse"):
        tm.class_tile_grads(e, w, inv, tgt, 1.0, inv, inv, inv)


def test_missing_triton_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.delitem(sys.modules, "partial_fc.tiles.triton", raising=False)
    with pytest.raises(ImportError, match="needs triton, which is not installed"):
        importlib.import_module("partial_fc.tiles.triton")


TRITON_MODULES = ("partial_fc.tiles.triton", "partial_fc.tiles.cublas",
                  "partial_fc.tiles.autotune",  # the launcher, its cuBLAS engine, its tuner
                  *(f"partial_fc.tiles.triton_kernels.{m}"  # the kernels themselves
                    for m in ("tile_ops", "forward", "dcos", "gemm")))


@pytest.mark.slow  # a fresh interpreter importing every partial_fc module: 3-15 s
def test_nothing_else_imports_triton():
    code = ("import pkgutil, sys, importlib, partial_fc\n"
            f"TRITON_MODULES = {TRITON_MODULES}\n"
            "for m in pkgutil.walk_packages(partial_fc.__path__, 'partial_fc.'):\n"
            "    if m.name not in TRITON_MODULES:\n"
            "        importlib.import_module(m.name)\n"
            "from partial_fc.tiles import triton_available\n"
            "assert triton_available()\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] == 'triton'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
