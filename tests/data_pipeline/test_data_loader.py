"""The streaming loader: equal batches per rank, exactly-once epochs, order, resume, errors.

Multi-rank loaders are built in one process with explicit rank/world_size (no process group).
"""

import shutil

import numpy as np
import pytest
import torch
from shard_helpers import epoch_keys, make_shards

from data_pipeline import epoch_plan, make_loader
from data_pipeline.errors import DataError, ShardError
from data_pipeline.manifest import Manifest, read_manifest, write_manifest

UNEVEN = [13, 5, 9, 1, 17, 8, 11]  # 64 samples


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("uneven"), UNEVEN, odd_size={3})


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_plan_covers_each_sample_once(world_size, num_workers):
    total = sum(UNEVEN)
    quota = total // world_size
    covered = []
    for rank in range(world_size):
        rank_count = 0
        for worker in range(num_workers):
            pieces = epoch_plan.worker_pieces(UNEVEN, seed=1, epoch=2, rank=rank,
                                              world_size=world_size, worker=worker,
                                              num_workers=num_workers)
            offsets = np.cumsum([0] + UNEVEN)
            for p in pieces:
                assert 0 <= p.start < p.stop <= UNEVEN[p.shard]
                covered.extend(range(offsets[p.shard] + p.start, offsets[p.shard] + p.stop))
                rank_count += p.stop - p.start
        assert rank_count == quota
    assert len(covered) == len(set(covered)) == quota * world_size


def test_consumed_positions_follow_round_robin_chunks():
    # worker chunks: w0 [2, 2, 1], w1 [2, 1]; order w0 w1 w0 w1 w0
    assert [epoch_plan.consumed_positions([5, 3], 2, n) for n in (0, 2, 4, 6, 7, 8)] == [
        [0, 0], [2, 0], [2, 2], [4, 2], [4, 3], [5, 3]]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_get_equal_batches_and_disjoint_samples(uneven, world_size):
    loaders = [make_loader(uneven, batch_size=4, rank=r, world_size=world_size, num_workers=2,
                           shuffle_buffer=8, with_keys=True) for r in range(world_size)]
    assert len({len(loader) for loader in loaders}) == 1
    keys = [epoch_keys(loader) for loader in loaders]
    assert [len(k) for k in keys] == [len(loaders[0]) * 4] * world_size
    union = [k for ks in keys for k in ks]
    assert len(union) == len(set(union))
    coverage = len(union) / sum(UNEVEN)
    print(f"world_size={world_size}: coverage {coverage:.3f}")
    assert coverage == pytest.approx(1 - loaders[0].dropped_fraction)
    assert coverage >= 1 - world_size * (4 + 1) / sum(UNEVEN)


def test_order_depends_on_seed_and_epoch_only(uneven):
    def order(seed, epoch, workers=2):
        loader = make_loader(uneven, batch_size=8, seed=seed, epoch=epoch, num_workers=workers,
                             shuffle_buffer=16, with_keys=True)
        return epoch_keys(loader)

    reference = order(0, 0)
    assert order(0, 0) == reference
    assert order(0, 1) != reference and order(1, 0) != reference
    unshuffled = epoch_keys(make_loader(uneven, batch_size=8, num_workers=0, shuffle=False,
                                        with_keys=True))
    assert unshuffled == [f"{i:09d}" for i in range(64)]


def test_flip_and_tuple_shape(uneven):
    plain = make_loader(uneven, batch_size=16, num_workers=0, flip=False)
    flipped = make_loader(uneven, batch_size=16, num_workers=0, flip=True)
    mirrored = 0
    for (a, la), (b, lb) in zip(plain, flipped, strict=True):
        assert torch.equal(la, lb)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y) or torch.equal(x, y.flip(-1))
            mirrored += not torch.equal(x, y)
    assert 0 < mirrored < 64


def _mirrored(batch: tuple) -> tuple:
    """A deferred-flip batch ``(images, labels, flips, keys)`` with its flips applied."""
    images, labels, flips, keys = batch
    return torch.where(flips.view(-1, 1, 1, 1), images.flip(-1), images), labels, keys


def _same_batches(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) and torch.equal(lx, ly) and kx == ky
        for (x, lx, kx), (y, ly, ky) in zip(a, b, strict=True))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_deferred_flip_hands_on_the_bits_of_the_flip_in_the_worker(uneven, num_workers):
    """``flip="deferred"`` yields the images as decoded plus the bits that, applied, give
    exactly the batches of the flip in the worker (the same draw per stream position)."""
    options = dict(batch_size=6, num_workers=num_workers, shuffle_buffer=8, seed=3,
                   with_keys=True)
    in_worker = list(make_loader(uneven, flip=True, **options))
    deferred = list(make_loader(uneven, flip="deferred", **options))
    assert _same_batches(in_worker, [_mirrored(b) for b in deferred])
    flips = torch.cat([b[2] for b in deferred])
    assert flips.dtype == torch.bool and 0 < int(flips.sum()) < len(flips)
    plain = [b[0] for b in make_loader(uneven, flip=False, **options)]
    assert all(torch.equal(a, b[0]) for a, b in zip(plain, deferred, strict=True))
    with pytest.raises(ValueError, match="flip='worker'"):
        make_loader(uneven, batch_size=6, flip="worker")


def test_deferred_flip_bits_follow_padding_and_a_resume_into_it(tmp_path):
    """Padding repeats a sample's flip bit with its image, also after a resume into the
    padded tail (its source is then read again in-process)."""
    folder = make_shards(tmp_path / "bad", [10, 10], corrupt={4, 9, 14, 15, 19})  # 15 good
    options = dict(batch_size=5, num_workers=0, with_keys=True, seed=1)  # 4th batch: padding
    for resume_after in (None, 2):
        runs = []
        for flip in (True, "deferred"):
            loader, first = make_loader(folder, flip=flip, **options), None
            if resume_after is not None:
                first = make_loader(folder, flip=flip, **options)
                for step, _ in enumerate(first):
                    if step == resume_after:
                        break
                loader.load_state_dict(first.state_dict())
            batches = list(loader)
            runs.append(batches if flip is True else [_mirrored(b) for b in batches])
            assert loader.num_padded == 5
        assert _same_batches(*runs) and len(runs[0]) == (4 if resume_after is None else 1)


def test_resume_mid_epoch_is_exact(uneven):
    kwargs = dict(batch_size=3, rank=1, world_size=2, num_workers=2, shuffle_buffer=8,
                  with_keys=True, seed=5)
    full = epoch_keys(make_loader(uneven, **kwargs))
    first = make_loader(uneven, **kwargs)
    seen = []
    for step, (_, _, keys) in enumerate(first):
        seen.extend(keys)
        if step == 3:
            break
    state = first.state_dict()
    assert state["batches"] == 4 and state["epoch"] == 0
    resumed = make_loader(uneven, **kwargs)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # same epoch: keeps the position
    rest = epoch_keys(resumed)
    assert len(seen) + len(rest) == len(full) and sorted(seen + rest) == sorted(full)
    assert resumed.batches_done == len(resumed)
    # the state of another rank (same settings) is converted by replaying the chunk schedule
    other = make_loader(uneven, **{**kwargs, "rank": 0})
    for step, _ in enumerate(other):
        if step == 3:
            break
    replay = make_loader(uneven, **kwargs)
    replay.load_state_dict(other.state_dict())
    assert replay.state_dict()["worker_positions"] == state["worker_positions"]
    # other settings: approximate, same fraction of the epoch
    changed = make_loader(uneven, **{**kwargs, "num_workers": 1})
    changed.load_state_dict(state)
    assert changed.batches_done == 4 and len(epoch_keys(changed)) == (len(changed) - 4) * 3
    changed.set_epoch(1)
    assert changed.batches_done == 0


def test_corrupt_samples_are_skipped_counted_and_padded(tmp_path):
    folder = make_shards(tmp_path / "bad", [10, 10], corrupt={4, 15})
    spare = make_loader(folder, batch_size=6, num_workers=2, with_keys=True)  # 3 batches, 18 good
    keys = epoch_keys(spare)
    assert len(keys) == 18 and len(set(keys)) == 18 and {"000000004", "000000015"}.isdisjoint(keys)
    assert spare.num_skipped == 2 and spare.num_padded == 0
    short = make_loader(folder, batch_size=5, num_workers=0, with_keys=True)  # needs 20 of 18
    keys = epoch_keys(short)
    assert len(keys) == 20 and len(set(keys)) == 18
    assert short.num_skipped == 2 and short.num_padded == 2


def test_resume_does_not_count_a_corrupt_sample_twice(tmp_path):
    folder = make_shards(tmp_path / "bad", [7, 9, 8], corrupt={1, 2, 5, 12, 13, 17, 20})
    kwargs = dict(batch_size=3, num_workers=2, shuffle_buffer=4)
    full = make_loader(folder, **kwargs)
    assert sum(1 for _ in full) == len(full) and full.num_skipped == 7
    first = make_loader(folder, **kwargs)
    for step, _ in enumerate(first):
        if step == 4:  # chunks prefetched past this point hold corrupt samples not yet passed
            break
    resumed = make_loader(folder, **kwargs)
    resumed.load_state_dict(first.state_dict())
    assert sum(1 for _ in resumed) == len(full) - 5 and resumed.num_skipped == 7


def test_resume_into_the_padded_tail_still_pads(tmp_path):
    folder = make_shards(tmp_path / "bad", [10, 10], corrupt={4, 9, 14, 15, 19})  # 15 good
    kwargs = dict(batch_size=5, num_workers=0, with_keys=True)  # 4 batches: the last is padding
    first = make_loader(folder, **kwargs)
    for step, _ in enumerate(first):
        if step == 2:  # every decodable sample handed out
            break
    resumed = make_loader(folder, **kwargs)
    resumed.load_state_dict(first.state_dict())
    keys = epoch_keys(resumed)
    assert len(keys) == 5 and resumed.num_padded == 5 and resumed.batches_done == 4


def test_missing_and_truncated_shards_name_the_file(uneven, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(uneven, folder)
    victim = folder / "shard-000004.tar"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(ShardError, match=r"shard-000004\.tar: .* bytes on disk"):
        make_loader(folder, batch_size=4)
    # a manifest that agrees with the truncated size: caught while reading (in-process here:
    # torch waits 5 s to reap a worker that raised; the message is the same from a worker)
    manifest = read_manifest(folder)
    shards = tuple(s if s.name != victim.name else type(s)(s.name, s.count, victim.stat().st_size)
                   for s in manifest.shards)
    write_manifest(folder, Manifest(manifest.num_classes, manifest.num_samples, shards))
    with pytest.raises(ShardError, match=r"shard-000004\.tar: .*truncated"):
        for _ in make_loader(folder, batch_size=4, num_workers=0):
            pass
    victim.unlink()
    with pytest.raises(ShardError, match=r"shard-000004\.tar: shard listed in the manifest"):
        make_loader(folder, batch_size=4)


def test_bad_arguments(uneven):
    with pytest.raises(DataError, match="cannot fill one batch of 40 on each of 2 ranks"):
        make_loader(uneven, batch_size=40, world_size=2)
    with pytest.raises(ValueError, match="rank=2 outside"):
        make_loader(uneven, batch_size=4, rank=2, world_size=2)
    with pytest.raises(DataError, match="no manifest"):
        make_loader(uneven / "nowhere", batch_size=4)


def test_loader_workers_outlive_a_job_wide_sigterm_and_sigusr1(synthetic_data):
    """A scheduler signals every process of the job; the loader's worker
    must not die before the trainer stops, so the epoch still yields every batch."""
    import multiprocessing
    import os
    import signal

    reference = [labels.tolist() for _, labels in make_loader(
        synthetic_data, batch_size=8, num_workers=0, flip=False)]
    got = []
    for i, (_, labels) in enumerate(make_loader(synthetic_data, batch_size=8, num_workers=1,
                                                flip=False)):
        got.append(labels.tolist())
        if i == 0:
            for child in multiprocessing.active_children():
                os.kill(child.pid, signal.SIGTERM)
                os.kill(child.pid, signal.SIGUSR1)
    assert got == reference


def test_a_worker_starts_with_its_ranks_heap_frozen_and_stop_signals_ignored():
    """The rank's objects go to the permanent generation in a worker (its collections then
    never walk, and copy on write, the rank's heap); SIGUSR1 is ignored there."""
    import gc
    import multiprocessing
    import signal

    from data_pipeline.epoch_stream import start_worker

    def worker(out):
        before = gc.get_freeze_count()
        start_worker(0)
        out.put((before, gc.get_freeze_count(), signal.getsignal(signal.SIGUSR1)))

    queue = multiprocessing.get_context("fork").SimpleQueue()
    child = multiprocessing.get_context("fork").Process(target=worker, args=(queue,))
    child.start()
    before, after, usr1 = queue.get()
    child.join()
    assert before == 0 and after > 1000 and usr1 == signal.SIG_IGN


def test_the_shuffle_draws_what_random_randint_draws():
    """ShuffleRandom's one-call randint keeps webdataset's shuffle order (and so the sample
    order a checkpoint's positions refer to) exactly as with random.Random."""
    import random

    from data_pipeline.stages import ShuffleRandom

    for seed in ("shuffle-0-0-0-0", "shuffle-3-1-2-1", 12345):
        ours, theirs = ShuffleRandom(seed), random.Random(seed)
        bounds = [(0, n) for n in range(1200)] + [(5, 7), (0, 2**40), (3, 3)]
        assert [ours.randint(a, b) for a, b in bounds * 2] == \
            [theirs.randint(a, b) for a, b in bounds * 2]
