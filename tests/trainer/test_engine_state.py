"""``trainer.engine.state.EngineState``: the sections an engine's state is made of, and the
flat names a checkpoint stores them under."""

from __future__ import annotations

import pytest
import torch
from launch_helpers import build_engine, make_config

from trainer.engine.state import EngineState, Rows


def test_flat_names_round_trip_through_the_sections():
    """Each entry comes back in its own section under its own key: every value is a distinct
    tensor, so a value put in another entry's place fails (``backbone.`` and ``backbone_``
    share a stem, as ``head.`` and ``head_opt.`` do)."""
    v = [torch.full((2,), float(i)) for i in range(5)]
    state = EngineState(head={"weight": Rows(v[0], 0, 2), "step": v[1]},
                        head_optimizer={"m": v[2]}, backbone={"fc.weight": v[3]},
                        backbone_optimizer={"opt.fc.weight.m": v[4]})
    flat = state.flat()
    names = ["head.weight", "head.step", "head_opt.m", "backbone.fc.weight",
             "backbone_opt.fc.weight.m"]
    assert sorted(flat) == sorted(names)
    assert all((flat[k].local if k == "head.weight" else flat[k]) is v[i]
               for i, k in enumerate(names))
    back = EngineState.from_flat(flat)
    for section in EngineState.PREFIXES:
        want, got = getattr(state, section), getattr(back, section)
        assert list(got) == list(want) and all(got[k] is want[k] for k in want), section
    with pytest.raises(KeyError, match="'stray.x': in no section"):
        EngineState.from_flat({"stray.x": v[0]})


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
