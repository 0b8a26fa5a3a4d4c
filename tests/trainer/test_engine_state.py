"""``trainer.engine.state.EngineState``: the sections an engine's state is made of, and the
flat names a checkpoint stores them under."""

from __future__ import annotations

import pytest
import torch
from launch_helpers import build_engine, make_config

from trainer.engine.state import EngineState, Rows


def test_flat_names_round_trip_through_the_sections():
    t = torch.ones(2)
    state = EngineState(head={"weight": Rows(t, 0, 2), "step": t}, head_optimizer={"m": t},
                        backbone={"fc.weight": t}, backbone_optimizer={"opt.fc.weight.m": t})
    flat = state.flat()
    assert sorted(flat) == ["backbone.fc.weight", "backbone_opt.fc.weight.m", "head.step",
                            "head.weight", "head_opt.m"]
    assert EngineState.from_flat(flat) == state
    with pytest.raises(KeyError, match="'stray.x': in no section"):
        EngineState.from_flat({"stray.x": t})


def test_an_engine_loads_its_own_state_into_a_fresh_engine(one_rank_group):
    from launch_helpers import local_micro_batches

    cfg = make_config("optim.name=adamw", "train.batch_size=4")
    trained, fresh = build_engine(cfg), build_engine(cfg)
    trained.step(0, local_micro_batches(0, 4, 0, 1, 1))
    state = trained.state_dict()
    assert isinstance(state.head["weight"], Rows) and state.head_optimizer
    plain = {k: v.local if isinstance(v, Rows) else v for k, v in state.flat().items()}
    fresh.load_state_dict(EngineState.from_flat(plain))
    again = fresh.state_dict().flat()
    for key, value in plain.items():
        other = again[key].local if isinstance(again[key], Rows) else again[key]
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), key
