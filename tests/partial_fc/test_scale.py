"""partial_fc.scale: AdaCos formulas, state, eval freeze (single process; the global
statistics across ranks are tested in test_head_distributed.py)."""

import math

import pytest
import torch

from partial_fc.scale import (
    AdaCosScale,
    FixedScale,
    dynamic_adacos_scale,
    fixed_adacos_scale,
    log_mean_exp,
    median_angle,
)


def test_fixed_adacos_value_and_error():
    assert fixed_adacos_scale(1001) == pytest.approx(math.sqrt(2) * math.log(1000))
    with pytest.raises(ValueError, match="num_classes=2"):
        fixed_adacos_scale(2)


def test_dynamic_formula_against_the_paper_written_directly():
    g = torch.Generator().manual_seed(0)
    cos = torch.rand(6, 50, generator=g, dtype=torch.float64) * 2 - 1
    labels = torch.tensor([0, 3, 7, 7, 49, 20])
    s_prev = 12.0
    onehot = torch.zeros_like(cos).scatter_(1, labels[:, None], 1.0)
    b_avg = (torch.exp(s_prev * cos) * (1 - onehot)).sum() / 6
    theta_med = torch.median(torch.acos(cos.gather(1, labels[:, None]).squeeze(1)))
    want = math.log(b_avg) / math.cos(min(math.pi / 4, theta_med.item()))
    log_b = torch.logsumexp(s_prev * cos + torch.log(1 - onehot), dim=1)
    got = dynamic_adacos_scale(log_mean_exp(log_b), median_angle(cos.gather(1, labels[:, None])))
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_median_angle_is_the_lower_middle_angle_and_clamps():
    cos = torch.tensor([1.0, 0.0, -1.0, 0.5, 1.0000001])
    assert median_angle(cos).item() == pytest.approx(math.pi / 3, rel=1e-6)
    even = torch.tensor([math.cos(0.1), math.cos(0.2), math.cos(0.3), math.cos(0.4)])
    assert median_angle(even).item() == pytest.approx(0.2, rel=1e-5)


def test_theta_med_is_capped_at_pi_over_4():
    s = dynamic_adacos_scale(torch.tensor(10.0), torch.tensor(1.2))
    assert s.item() == pytest.approx(10.0 / math.cos(math.pi / 4))


def test_update_only_when_dynamic_and_training():
    dyn, fixed = AdaCosScale(dynamic=True), AdaCosScale(dynamic=False)
    for sc in (dyn, fixed):
        sc.reset(1001)
    s0 = math.sqrt(2) * math.log(1000)
    assert dyn.value().item() == pytest.approx(s0)
    fixed.update(torch.tensor(5.0), torch.tensor(0.5))
    assert fixed.value().item() == pytest.approx(s0)
    dyn.eval()
    dyn.update(torch.tensor(5.0), torch.tensor(0.5))
    assert dyn.value().item() == pytest.approx(s0)
    dyn.train()
    dyn.update(torch.tensor(5.0), torch.tensor(0.5))
    assert dyn.value().item() == pytest.approx(5.0 / math.cos(0.5))
    assert dyn.value().dtype == torch.float32


def test_state_dict_round_trip_resumes_the_same_scale():
    a = AdaCosScale(dynamic=True)
    a.reset(100)
    a.update(torch.tensor(7.0), torch.tensor(0.3))
    b = AdaCosScale(dynamic=True)
    b.reset(100)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.s, b.s)


def test_fixed_scale_validates():
    assert FixedScale(30.0).value() == 30.0
    with pytest.raises(ValueError, match="s=0.0"):
        FixedScale(0.0)
