"""``data.dirs``: two folders with different class counts and weights in one loader; each
read exactly once per its own epoch, exact resume across a set's epoch boundary, labels that
never collide."""

import pytest
import torch
from shard_helpers import make_shards

from data_pipeline.errors import DataError
from data_pipeline.exclusion import Exclusions, write_exclusions
from data_pipeline.mixture import batch_shares, make_mixed_loader

# set 0: 40 samples of 5 classes, set 1: 21 of 3; a batch of 4 = 3 + 1 (weights 3:1)
A, B = ([9, 15, 16], 5), ([7, 14], 3)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    return [make_shards(root / name, counts, num_classes=classes)
            for name, (counts, classes) in (("a", A), ("b", B))]


def mixed(folders, **kwargs):
    options = dict(batch_size=4, weights=[3.0, 1.0], num_workers=0, shuffle_buffer=5,
                   with_keys=True, seed=2)
    return make_mixed_loader(folders, **{**options, **kwargs})


def read(loader, batches):
    """(set, key, label) of the next `batches` batches, across the mixture's epochs."""
    out = []
    while len(out) < batches * 4:
        for _, labels, keys in loader:
            out += [(*k.split(":"), int(lab)) for k, lab in zip(keys, labels, strict=True)]
            if len(out) == batches * 4:
                return out
        loader.set_epoch(loader.epoch + 1)
    return out


def test_batch_shares():
    assert batch_shares(4, [3.0, 1.0]) == [3, 1]
    assert batch_shares(10, [1, 1, 1]) == [4, 3, 3] and sum(batch_shares(7, [5, 1e-9])) == 7
    assert batch_shares(3, [1000, 1]) == [2, 1]  # every set at least one sample
    with pytest.raises(ValueError, match="fewer samples than the 3 data sets"):
        batch_shares(2, [1, 1, 1])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_set_once_per_its_epoch_with_its_labels(folders, num_workers):
    loader = mixed(folders, num_workers=num_workers)
    assert len(loader) == 21 and loader.num_classes == 8  # set 1 (21 samples, 1 a batch)
    samples = read(loader, 2 * 21)  # two mixture epochs: set 1 twice, set 0 126 / 39 times
    for s, offset, classes, total, epoch_len in (("0", 0, 5, 40, 39), ("1", 5, 3, 21, 21)):
        mine = [(k, lab) for t, k, lab in samples if t == s]
        assert len(mine) == 2 * 21 * (3 if s == "0" else 1)
        for key, label in mine:  # its own labels, offset into one class space
            assert offset <= label == offset + int(key) % classes < offset + classes
        for start in range(0, len(mine) - epoch_len + 1, epoch_len):  # once per its epoch
            keys = {k for k, _ in mine[start:start + epoch_len]}
            assert len(keys) == epoch_len >= total - 1


def test_deferred_flip_bits_follow_their_samples(folders):
    """The sets' flip bits are cut together with their images: applied, they give the
    batches of the flip in the sets' workers."""
    in_worker, deferred = mixed(folders, flip=True), mixed(folders, flip="deferred")
    for (want, labels, keys), (images, got_labels, flips, got_keys) in zip(
            in_worker, deferred, strict=True):
        assert keys == got_keys and torch.equal(labels, got_labels) and len(flips) == 4
        assert torch.equal(torch.where(flips.view(-1, 1, 1, 1), images.flip(-1), images), want)


def test_resume_across_a_set_epoch_boundary_is_exact(folders):
    reference = read(mixed(folders), 30)
    for stop in (12, 13, 21, 22):  # set 0 ends its epochs at batch 13, set 1 at 21
        first = mixed(folders)
        seen = read(first, stop)
        resumed = mixed(folders)
        resumed.load_state_dict(first.state_dict())
        resumed.set_epoch(first.epoch)
        rest = read(resumed, 30 - stop)
        assert sorted(seen[: stop * 4]) == sorted(reference[: stop * 4])
        for s in ("0", "1"):  # per set: the same samples in the same order as unbroken
            assert [x for x in seen + rest if x[0] == s] == [x for x in reference if x[0] == s]


def test_exclusions_apply_per_set_in_its_own_labels(folders, tmp_path):
    path = tmp_path / "b.txt"
    write_exclusions(path, Exclusions(classes=frozenset({1})))  # class 1 of set 1 = label 6
    loader = mixed(folders, excludes=[None, path])
    assert loader.num_excluded == 7
    labels = {lab for _, _, lab in read(loader, 14)}
    assert 6 not in labels and {0, 1, 2, 3, 4, 5, 7} <= labels


def test_state_of_another_mixture_is_refused(folders):
    loader = mixed(folders)
    state = loader.state_dict()
    state["sets"] = state["sets"][:1]
    with pytest.raises(DataError, match="saved with 1 data folders, this run has 2"):
        loader.load_state_dict(state)
