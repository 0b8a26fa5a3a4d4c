"""``trainer.engine.snapshot.Snapshot``: what a skipped step puts back."""

from __future__ import annotations

import torch
from torch import nn

from partial_fc import PartialFC, build_margin


def test_restore_puts_back_every_buffer_and_the_head_step():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4).double(),
                        nn.BatchNorm1d(4).double())
    head = PartialFC(4, 10, build_margin({"type": "adacos", "adacos": "dynamic"}))
    head(torch.randn(6, 4), torch.arange(6))
    before = {k: v.clone() for m in (net, head) for k, v in m.state_dict().items()}
    from trainer.engine.snapshot import Snapshot

    saved = Snapshot((net, head), head)
    assert len(saved.groups) == 3  # float32, float64, int64: one copy each
    net[1](torch.randn(8, 4))
    net[3](torch.randn(8, 4, dtype=torch.float64))
    head(torch.randn(6, 4), torch.arange(6))
    after = {k: v for m in (net, head) for k, v in m.state_dict().items()}
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert {"1.running_mean", "3.running_var", "1.num_batches_tracked", "step",
            "margin.scale.s"} <= set(moved), moved
    saved.restore()
    now = {k: v for m in (net, head) for k, v in m.state_dict().items()}
    assert all(torch.equal(before[k], now[k]) for k in before)
    assert head.step == 1
