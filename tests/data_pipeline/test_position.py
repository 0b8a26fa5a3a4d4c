"""``data_pipeline.position``: the loaders' typed positions and plans; the dict a checkpoint
stores is the one the loaders wrote before they were typed, and it converts losslessly."""

import json

import pytest
from shard_helpers import make_shards

from data_pipeline import SyntheticStream, make_loader
from data_pipeline.mixture import make_mixed_loader
from data_pipeline.position import (
    ImportedPlan,
    MixturePosition,
    ShardPlan,
    ShardPosition,
    SyntheticPlan,
    SyntheticPosition,
)

SHARD = dict(batch_size=3, rank=1, world_size=2, num_workers=2, shuffle_buffer=8, seed=5)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("position")
    return [make_shards(root / "a", [13, 5, 9, 17]), make_shards(root / "b", [7, 14])]


def advanced(loader, batches: int):
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return loader


def shard_dict(loader) -> dict:
    """A shard loader's state as the untyped loader wrote it (no ``excluded`` key)."""
    return {"epoch": loader.epoch, "batches": loader.batches_done, "rank": loader.rank,
            "worker_positions": list(loader._positions), "num_skipped": loader.num_skipped,
            "num_padded": loader.num_padded,
            "plan": {"seed": 5, "world_size": 2, "num_workers": 2, "batch_size": 3,
                     "num_samples": loader.num_samples, "shuffle": True, "shuffle_buffer": 8}}


def stored(state: dict) -> dict:
    return json.loads(json.dumps(state))  # as meta.json holds it


def test_an_old_shard_state_loads_exactly(folders):
    first = advanced(make_loader(folders[0], **SHARD), 3)
    old = shard_dict(first)
    assert json.dumps(first.state_dict()) == json.dumps(old)  # the same keys, in order
    resumed = make_loader(folders[0], **SHARD)
    resumed.load_state_dict(stored(old))
    assert resumed.position() == first.position() and resumed.batches_done == 3


def test_an_old_synthetic_state_loads_exactly():
    first = advanced(SyntheticStream(9, 4, batch_size=2, rank=1, world_size=2, seed=2), 4)
    old = {"epoch": 0, "batches": 4, "rank": 1, "plan": {
        "source": "synthetic", "seed": 2, "num_samples": 36, "num_classes": 9,
        "global_batch": 4}}
    assert json.dumps(first.state_dict()) == json.dumps(old)
    resumed = SyntheticStream(9, 4, batch_size=2, rank=1, world_size=2, seed=2)
    resumed.load_state_dict(stored(old))
    assert resumed.position() == first.position()


def test_an_old_mixture_state_loads_exactly(folders):
    options = dict(batch_size=4, weights=[3.0, 1.0], num_workers=0, seed=5)
    first = advanced(make_mixed_loader(folders, **options), 5)
    old = {"epoch": 0, "batches": 5, "sets": [s.state_dict() for s in first.sets]}
    assert json.dumps(first.state_dict()) == json.dumps(old)
    resumed = make_mixed_loader(folders, **options)
    resumed.load_state_dict(stored(old))
    assert resumed.position() == first.position()


def test_an_imported_position_starts_every_loader_at_its_epoch(folders):
    imported = {"epoch": 3, "batches": 0, "rank": 0, "worker_positions": [],
                "plan": {"source": "arcface_torch", "num_samples": 0, "world_size": 1,
                         "batch_size": 1}}
    for loader in (make_loader(folders[0], **SHARD), SyntheticStream(9, 4, batch_size=2)):
        advanced(loader, 1).load_state_dict(imported)
        assert (loader.epoch, loader.batches_done) == (3, 0)
    assert make_loader(folders[0], **SHARD).position().plan != ImportedPlan()


@pytest.mark.parametrize("position", [
    ShardPosition(2, 7, 1, (4, 0, 9), 2, 1, ShardPlan(5, 2, 3, 3, 64, True, 8)),
    ShardPosition(0, 1, 0, (1,), 0, 0, ShardPlan(5, 1, 1, 3, 64, False, 0, "3-0badf00d")),
    ShardPosition(1, 0, 0, (), 0, 0, ImportedPlan()),
    SyntheticPosition(4, 2, 1, SyntheticPlan(2, 36, 9, 4)),
    SyntheticPosition(4, 2, 1, ShardPlan(5, 2, 3, 3, 64, True, 8)),  # read by another kind
    MixturePosition(1, 3, (ShardPosition(0, 3, 0, (2, 5), 0, 0, ShardPlan(5, 1, 2, 3, 40,
                                                                        True, 5)),)),
])
def test_the_dict_round_trip_is_lossless(position):
    state = stored(position.to_dict())
    assert type(position).from_dict(state) == position
    assert stored(type(position).from_dict(state).to_dict()) == state


@pytest.mark.parametrize("state", [
    {"epoch": 0, "batches": 1, "rank": 0, "plan": {}},  # no worker positions
    {"epoch": "x", "batches": 1, "rank": 0, "worker_positions": [], "plan": {}},
    {"epoch": 0, "batches": 1, "rank": 0, "worker_positions": [], "plan": {"source": "?"}},
    {"epoch": 0, "batches": 1, "rank": 0, "worker_positions": [],
     "plan": {**ShardPlan(5, 2, 3, 3, 64, True, 8).to_dict(), "num_samples": "64"}},
    {"epoch": 0, "batches": 1, "sets": []},  # a mixture's
])
def test_a_malformed_state_is_one_line(folders, state):
    for loader in (make_loader(folders[0], **SHARD), SyntheticStream(9, 4, batch_size=2)):
        with pytest.raises(ValueError, match=r"^loader state_dict: malformed \([^\n]*\)$"):
            loader.load_state_dict(state)
