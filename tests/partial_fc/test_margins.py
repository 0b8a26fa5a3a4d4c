"""partial_fc.margins: values, exact derivatives, monotonicity, no NaN/inf, config errors."""

import math

import pytest
import torch

from partial_fc import build_margin
from partial_fc.margins import CombinedMargin, SphereFaceMargin
from partial_fc.scale import AdaCosScale, FixedScale

# The keys every type reads (partial_fc.margins.keys.SharedConfig), as the schema passes them.
FULL_CFG = dict(s=64.0, adacos=None, warmup_steps=0, gradient="exact", interclass_filter=0.0,
                subcenters=1)
CASES = {
    "normface": dict(type="normface"),
    "sphereface": dict(type="sphereface", m=4, lambda_base=0.0),
    "sphereface_anneal": dict(type="sphereface", m=4),
    "cosface": dict(type="cosface", m=0.35),
    "arcface": dict(type="arcface", m=0.5),
    "arcface_easy": dict(type="arcface", m=0.5, easy_margin=True),
    "combined": dict(type="combined", m1=1.2, m2=0.3, m3=0.1),
    "adacos": dict(type="adacos", adacos="dynamic"),
}


def _psi(margin, c, step=0):
    return margin.psi(torch.as_tensor(c, dtype=torch.float64), step).double()


def test_closed_forms():
    c = torch.linspace(-0.7, 0.95, 41, dtype=torch.float64)  # before any fallback
    th = torch.acos(c)
    pairs = {
        "normface": c,
        "cosface": c - 0.35,
        "arcface": torch.cos(th + 0.5),
        "combined": torch.cos(1.2 * th + 0.3) - 0.1,
    }
    for name, want in pairs.items():
        got = _psi(build_margin(CASES[name]), c)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


def test_arcface_fallbacks():
    arc = build_margin(dict(type="arcface", m=0.5))
    c = torch.tensor([-0.99, -0.95, -0.9])  # theta > pi - 0.5: cos < -0.8776
    want = c.double() - 0.5 * math.sin(0.5)
    torch.testing.assert_close(_psi(arc, c), want, rtol=0, atol=1e-6)
    inside = torch.tensor([-0.85])
    torch.testing.assert_close(_psi(arc, inside), torch.cos(torch.acos(inside.double()) + 0.5),
                               rtol=0, atol=1e-6)
    # easy_margin is not monotone: it jumps back up to cos(theta) at theta = pi/2.
    easy = build_margin(dict(type="arcface", m=0.5, easy_margin=True))
    c = torch.tensor([-0.99, -0.3, 0.0, 0.3])
    want = torch.cat([c[:3].double(), torch.cos(torch.acos(c[3:].double()) + 0.5)])
    torch.testing.assert_close(_psi(easy, c), want, rtol=0, atol=1e-6)


def test_combined_fallback_continues_the_first_order_penalty():
    m = CombinedMargin(FixedScale(1.0), m1=1.2, m2=0.3, m3=0.1)
    th_th = (math.pi - 0.3) / 1.2
    c = torch.tensor([math.cos(th_th + 0.1), -0.999])
    want = c.double() - 0.1 - (math.pi - th_th) * math.sin(th_th)
    torch.testing.assert_close(_psi(m, c), want, rtol=0, atol=1e-6)


def test_arcface_gradient_is_exact():
    arc = build_margin(dict(type="arcface", m=0.5))
    c = torch.linspace(-0.85, 0.99, 30).requires_grad_()
    arc.psi(c, 0).sum().backward()
    cd = c.detach().double()
    want = math.cos(0.5) + math.sin(0.5) * cd / torch.sqrt(1 - cd**2)
    torch.testing.assert_close(c.grad.double(), want, rtol=1e-4, atol=1e-5)


def test_sphereface_values_and_exact_derivative_at_cos_one():
    sph = SphereFaceMargin(FixedScale(1.0), m=4, lambda_base=0.0)
    for theta in (0.1, 0.7, 1.0, 1.7, 2.5, 3.0):
        k = math.floor(4 * theta / math.pi)
        want = (-1) ** k * math.cos(4 * theta) - 2 * k
        got = _psi(sph, [math.cos(theta)]).item()
        assert got == pytest.approx(want, abs=1e-5), theta
    c = torch.tensor([1.0, -1.0], requires_grad=True)
    sph.psi(c, 0).sum().backward()
    # d/dc [(-1)^k T_4(c) - 2k] = (-1)^k T_4'(c); T_m'(1) = m^2, T_m'(-1) = -m^2 (k = 3 at -1)
    torch.testing.assert_close(c.grad, torch.tensor([16.0, 16.0]))
    anneal = SphereFaceMargin(FixedScale(1.0), m=4, lambda_base=10.0, lambda_min=2.0)
    c = torch.tensor([1.0], requires_grad=True)
    anneal.psi(c, 0).sum().backward()
    torch.testing.assert_close(c.grad, torch.tensor([(10.0 + 16.0) / 11.0]))


def test_sphereface_lambda_schedule():
    sph = SphereFaceMargin(FixedScale(1.0), m=4, lambda_base=1000.0, lambda_gamma=0.12,
                           lambda_power=1.0, lambda_min=5.0)
    assert sph.lambda_at(0) == 1000.0
    assert sph.lambda_at(100) == pytest.approx(1000.0 / 13.0)
    assert sph.lambda_at(10**6) == 5.0
    assert SphereFaceMargin(FixedScale(1.0), lambda_base=0.0).lambda_at(5) == 0.0
    c = torch.tensor([0.3])
    mixed = _psi(sph, c, step=100).item()
    lam = 1000.0 / 13.0
    pure = _psi(SphereFaceMargin(FixedScale(1.0), lambda_base=0.0), c).item()
    assert mixed == pytest.approx((lam * 0.3 + pure) / (1 + lam), abs=1e-6)


@pytest.mark.parametrize("name", sorted(set(CASES) - {"arcface_easy"}))
def test_monotone_in_theta(name):
    margin = build_margin(CASES[name])
    theta = torch.linspace(0, math.pi, 20001, dtype=torch.float64)
    psi = _psi(margin, torch.cos(theta), step=3)
    assert (psi[1:] - psi[:-1] <= 1e-6).all(), name


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_nan_or_inf_gradient_at_the_ends(name):
    margin = build_margin(CASES[name])
    c = torch.tensor([1.0, -1.0, 1 - 1e-8, -1 + 1e-8, 1 + 1e-7, -1 - 1e-7, 0.0, 1e-30],
                     requires_grad=True)
    out = margin.psi(c, 0)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(c.grad).all(), (out, c.grad)
    assert out.dtype == torch.float32


def test_build_margin_refuses_a_key_of_another_type():
    """The schema holds each type's keys only; ``build_margin`` holds a dict to the same rule
    (a None value counts as absent)."""
    with pytest.raises(ValueError, match=r"margin.m1=1.0: only read by margin.type=combined "
                                         r"\(arcface's own keys: m, easy_margin\)"):
        build_margin(dict(type="arcface", m1=1.0))
    assert build_margin(dict(type="arcface", m1=None)).m2 == 0.5


def test_build_margin_reads_the_shared_keys_with_every_type():
    from partial_fc.margins import REGISTRY

    for kind in REGISTRY:
        build_margin(dict(FULL_CFG, type=kind, adacos="fixed" if kind == "adacos" else None))
    ada = build_margin(dict(FULL_CFG, type="adacos", adacos="fixed"))
    assert isinstance(ada.scale, AdaCosScale) and not ada.scale.dynamic
    arc_dyn = build_margin(dict(FULL_CFG, type="arcface", adacos="dynamic"))
    assert isinstance(arc_dyn.scale, AdaCosScale) and arc_dyn.scale.dynamic
    assert arc_dyn.m2 == 0.5
    assert build_margin(dict(type="cosface", s=30.0)).scale.value() == 30.0
    # Each key reaches its place in cos(m1 θ + m2) - m3 (reading the attributes back would
    # only repeat the constructor call).
    combined = build_margin(dict(FULL_CFG, type="combined", m1=1.1, m2=0.2, m3=0.05))
    want = math.cos(1.1 * math.acos(0.5) + 0.2) - 0.05
    assert _psi(combined, [0.5]).item() == pytest.approx(want, abs=1e-6)


def test_scale_state_is_in_state_dict():
    ada = build_margin(dict(type="arcface", m=0.5, adacos="dynamic"))
    assert list(ada.state_dict()) == ["scale.s"]
    assert list(build_margin(dict(type="arcface")).state_dict()) == []


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        (dict(type="arcface", margin=0.5), "unknown key(s) ['margin']"),
        (dict(type="arcfce"), "type='arcfce'"),
        (dict(type="adacos"), "type=adacos needs adacos=fixed|dynamic"),
        (dict(type="cosface", adacos="dyn"), "adacos='dyn'"),
        (dict(type="sphereface", m=2.5), "m=2.5"),
        (dict(type="arcface", m=3.5), "m=3.5"),
        (dict(type="cosface", m=-0.1), "m=-0.1"),
        (dict(type="cosface", s=-1.0), "s=-1.0"),
        (dict(type="combined", m1=1.0, m2=2.0, easy_margin=True), "easy_margin"),
        (dict(type="sphereface", lambda_min=-1.0), "lambda_min=-1.0"),
    ],
)
def test_build_margin_errors_name_the_value(cfg, needle):
    with pytest.raises(ValueError, match="margin") as err:
        build_margin(cfg)
    assert needle in str(err.value)
