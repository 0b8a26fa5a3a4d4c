"""``margin.warmup_steps``: the margin ramps in from 0 over the head's training forwards, for
every margin type, and a checkpoint (the head's state_dict) resumes the ramp where it was."""

from __future__ import annotations

import math

import pytest
import torch

from partial_fc import PartialFC, build_margin
from partial_fc.margins.registry import margin_errors
from partial_fc.margins.step import MarginBatch

TYPES = {
    "normface": dict(type="normface"),
    "sphereface": dict(type="sphereface", m=4),
    "cosface": dict(type="cosface", m=0.35),
    "arcface": dict(type="arcface", m=0.5),
    "combined": dict(type="combined", m1=1.2, m2=0.3, m3=0.1),
    "adacos": dict(type="adacos", adacos="fixed"),
}
COS = torch.linspace(-0.9, 0.95, 23, dtype=torch.float64)


def _target(margin, cos, step):
    """The target value the head uses after ``step`` steps (``Margin.begin``'s psi)."""
    batch = MarginBatch(cos.float(), None, slice(0, len(cos)), step, 0, True)
    return margin.begin(batch).psi(cos, None)


@pytest.mark.parametrize("name", sorted(TYPES))
def test_ramp_from_no_margin_to_the_full_margin(name):
    warm = build_margin({**TYPES[name], "warmup_steps": 10})
    full = build_margin(TYPES[name])
    for step in (0, 4, 10, 25):
        t = min(1.0, step / 10)
        psi = full.psi(COS, step).double()
        want = (1 - t) * COS + t * psi  # the penalty cos - psi scaled by t
        got = _target(warm, COS, step).double()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"{name} step {step}")
    torch.testing.assert_close(_target(warm, COS, 0).double(), COS, rtol=0, atol=1e-7)
    assert torch.equal(_target(warm, COS, 10), _target(full, COS, 10))


def test_cosface_ramp_is_the_margin_times_t():
    warm = build_margin(dict(type="cosface", m=0.4, warmup_steps=8))
    torch.testing.assert_close(_target(warm, COS, 2).double(), COS - 0.4 * 2 / 8, rtol=0,
                               atol=1e-6)


def test_ramped_targets_keep_falling_with_the_angle():
    warm = build_margin(dict(type="arcface", m=0.5, warmup_steps=10))
    theta = torch.linspace(0, math.pi, 200, dtype=torch.float64)
    for step in (0, 3, 7):
        values = _target(warm, torch.cos(theta), step).double()
        assert (values.diff() <= 1e-9).all(), step


def test_head_uses_the_ramp_and_a_checkpoint_resumes_it():
    """Training forwards advance the ramp; the head's state_dict (its ``step`` buffer)
    carries it: a fresh head loaded from it computes the same next loss."""
    torch.manual_seed(0)
    cfg = dict(type="arcface", m=0.5, s=16.0, warmup_steps=4)
    e, y = torch.randn(6, 8), torch.tensor([0, 1, 2, 3, 4, 5])
    head = PartialFC(8, 10, build_margin(cfg), seed=3)
    plain = PartialFC(8, 10, build_margin({**cfg, "warmup_steps": 0}), seed=3)
    normface = PartialFC(8, 10, build_margin({**cfg, "type": "normface", "m": None}), seed=3)

    def loss(h: PartialFC) -> float:
        return h(e, y).item()

    with torch.no_grad():
        assert loss(head) == pytest.approx(loss(normface), rel=1e-6)  # step 0: no margin
        losses = [loss(head) for _ in range(2)]  # steps 1, 2: the margin grows
        assert losses[0] < losses[1] < loss(plain)
        resumed = PartialFC(8, 10, build_margin(cfg), seed=3)
        resumed.load_state_dict(head.state_dict())
        assert int(resumed.step) == 3
        assert loss(resumed) == loss(head)  # step 3 on both
        assert loss(head) == loss(plain)  # step 4: the full margin


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_bad_warmup_steps_is_named(bad):
    errors = margin_errors({**TYPES["cosface"], "warmup_steps": bad})
    assert [key for key, _ in errors] == ["margin.warmup_steps"]
    with pytest.raises(ValueError, match="margin.warmup_steps"):
        build_margin({**TYPES["cosface"], "warmup_steps": bad})
