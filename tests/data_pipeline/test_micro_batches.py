"""data_pipeline.micro_batches: with train.global_batch, micro-batch j of step t holds the
same samples on any world size, and a position saved on P ranks resumes on P' exactly (no
sample lost or read twice); on lists of keys, no training."""

from __future__ import annotations

import pytest
from shard_helpers import make_shards

from data_pipeline import SyntheticStream, make_loader
from data_pipeline.micro_batches import MicroBatchStreams, rank_streams

STREAMS, BATCH = 4, 3  # a step: 4 micro-batches of 3


def _shards(folder):
    def make(rank: int, world_size: int):
        return MicroBatchStreams(
            lambda j: make_loader(folder, batch_size=BATCH, rank=j, world_size=STREAMS, seed=5,
                                  num_workers=0, with_keys=True, shuffle_buffer=8),
            rank=rank, world_size=world_size, streams=STREAMS)
    return make


def _synthetic(rank: int, world_size: int):
    return MicroBatchStreams(
        lambda j: SyntheticStream(7, 10, batch_size=BATCH, rank=j, world_size=STREAMS, seed=5,
                                  with_keys=True),
        rank=rank, world_size=world_size, streams=STREAMS)


def _steps(loaders: list[MicroBatchStreams], steps: int | None = None) -> list[list[tuple]]:
    """Per step, its micro-batches' keys in micro-batch order j (pass p of rank r is
    micro-batch p * P + r)."""
    world, k = len(loaders), len(loaders[0].streams)
    its = [iter(loader) for loader in loaders]
    out = []
    while steps is None or len(out) < steps:
        try:
            passes = [[tuple(next(it)[-1]) for _ in range(k)] for it in its]
        except StopIteration:
            break
        out.append([passes[j % world][j // world] for j in range(STREAMS)])
    return out


@pytest.fixture(scope="module")
def shard_folder(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("shards"), [9, 14, 11, 8])


def test_rank_streams_split_the_step_in_pass_order():
    assert [rank_streams(r, 2, 4) for r in (0, 1)] == [[0, 2], [1, 3]]
    assert rank_streams(0, 1, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="3 ranks cannot split 4"):
        rank_streams(0, 3, 4)


@pytest.mark.parametrize("source", ["shards", "synthetic"])
def test_each_micro_batch_holds_the_same_samples_on_any_world_size(source, shard_folder):
    make = _shards(shard_folder) if source == "shards" else _synthetic
    epochs = {p: _steps([make(r, p) for r in range(p)]) for p in (1, 2, 4)}
    assert epochs[1] == epochs[2] == epochs[4]
    keys = [key for step in epochs[1] for batch in step for key in batch]
    assert len(epochs[1]) == len(make(0, 1)) // STREAMS >= 2
    assert len(keys) == len(set(keys))  # each sample at most once per epoch


@pytest.mark.parametrize("before,after", [(2, 4), (4, 1), (1, 2)])
def test_a_position_saved_on_p_ranks_resumes_exactly_on_another_world_size(
        before, after, shard_folder):
    make = _shards(shard_folder)
    whole = _steps([make(r, 1) for r in range(1)])
    first = [make(r, before) for r in range(before)]
    done = _steps(first, 2)
    states = [loader.state_dict() for loader in first]
    resumed = [make(r, after) for r in range(after)]
    for r, loader in enumerate(resumed):
        loader.load_saved(states, r)
        assert loader.batches_done == 2 * len(loader.streams)
    assert done + _steps(resumed) == whole


def test_the_position_round_trips_through_its_stored_form(shard_folder):
    loader = _shards(shard_folder)(1, 2)
    _steps([_shards(shard_folder)(0, 2), loader], 1)
    again = _shards(shard_folder)(1, 2)
    again.load_state_dict(loader.state_dict())
    assert again.position() == loader.position() and again.batches_done == 2
    assert [j for j, _ in again.position().streams] == [1, 3]
