"""partial_fc.sampling: sample size, positives kept, label remap, seeded determinism."""

import math

import pytest
import torch
from host_reads import HostReads

from partial_fc.init import derive_seed
from partial_fc.sampling import local_targets, sample_classes, sample_size


@pytest.mark.parametrize(
    ("rate", "n", "want"),
    [(0.7, 10, 7), (0.1, 1001, 101), (1.0, 13, 13), (0.001, 5, 1), (0.3, 10, 3), (0.25, 9, 3),
     (1e-9, 10, 1)],
)
def test_sample_size_is_ceil_without_rounding_surprises(rate, n, want):
    assert sample_size(rate, n) == want


@pytest.mark.parametrize("rate", [1e-9, 0.0])
def test_tiny_rate_without_positives_still_samples_a_class(rate):
    index, targets = sample_classes(torch.tensor([0, 1]), 10, 10, rate, seed=0, step=0, rank=1)
    assert index is not None and len(index) == 1 and targets.tolist() == [-1, -1]


def test_rate_zero_keeps_the_positives_only():
    """arcface_torch's ``sample_rate = 0``: PartialFC_V2 keeps the batch's own classes."""
    index, targets = sample_classes(torch.tensor([3, 7, 3]), 0, 10, 0.0, seed=0, step=0, rank=0)
    assert index.tolist() == [3, 7] and targets.tolist() == [0, 1, 0]


def test_local_targets_marks_other_shards():
    labels = torch.tensor([0, 9, 10, 19, 20, 15])
    assert local_targets(labels, 10, 10).tolist() == [-1, -1, 0, 9, -1, 5]


def _sample(labels, step=0, rank=0, start=100, num_local=200, rate=0.1, seed=0):
    return sample_classes(torch.tensor(labels), start, num_local, rate, seed, step, rank)


def test_positives_kept_size_and_remap():
    labels = [100, 150, 150, 299, 5, 300, 120]
    index, targets = _sample(labels)
    assert len(index) == 20 and torch.equal(index, torch.unique(index))
    owned = [y - 100 for y in labels if 100 <= y < 300]
    assert set(owned) <= set(index.tolist())
    for y, t in zip(labels, targets.tolist(), strict=True):
        if 100 <= y < 300:
            assert index[t].item() == y - 100
        else:
            assert t == -1


def test_more_positives_than_the_rate_keeps_them_all():
    labels = list(range(100, 130))  # 30 positives > ceil(0.1 * 200) = 20
    index, _ = _sample(labels)
    assert index.tolist() == list(range(30))


@pytest.mark.parametrize(("rate", "reads"), [(0.05, 0), (0.045, 1)])  # 10 or 9 of 200 rows
def test_a_sample_the_batch_cannot_outnumber_is_drawn_without_a_host_read(rate, reads):
    """10 labels, all distinct positives: a sample of 10 rows holds them all without counting
    them; a sample of 9 must count them (one read) and grows to 10."""
    labels = [100 + 20 * k for k in range(10)]
    with HostReads() as counted:
        index, targets = _sample(labels, rate=rate)
    assert len(counted) == reads, counted.table()
    assert index.tolist() == [y - 100 for y in labels] and targets.tolist() == list(range(10))


def test_full_sample_returns_none():
    index, targets = _sample([100, 101], rate=1.0)
    assert index is None and targets.tolist() == [0, 1]
    index, _ = _sample(list(range(100, 300)), rate=0.5)  # every class is a positive
    assert index is None


def test_negatives_are_seeded_by_seed_step_rank():
    a = _sample([150], step=3, rank=1)[0]
    assert torch.equal(a, _sample([150], step=3, rank=1)[0])
    for other in (dict(step=4, rank=1), dict(step=3, rank=2), dict(step=3, rank=1, seed=1)):
        assert not torch.equal(a, _sample([150], **other)[0]), other


def test_derive_seed():
    assert derive_seed(1, 2, 3) == derive_seed(1, 2, 3) != derive_seed(1, 3, 2)
    assert 0 <= derive_seed(0) < 2**63
    with pytest.raises(ValueError, match="must be >= 0"):
        derive_seed(-1)


@pytest.mark.parametrize("rate", [0.4, 0.8])  # draws the kept rows / the dropped rows
def test_negatives_are_a_uniform_subset_of_the_non_positives(rate):
    """Same distribution as a top-k of uniform scores (what the AdaCos B correction
    assumes): every non-positive is kept with probability count/free and every pair with
    probability count(count-1)/(free(free-1)). 2000 seeded draws: 4-sigma bounds, no flake."""
    trials, num_local, positive = 2000, 10, 2
    counts, pairs = torch.zeros(num_local), torch.zeros(num_local, num_local)
    for step in range(trials):
        index, _ = _sample([100 + positive], step=step, num_local=num_local, rate=rate)
        assert positive in index.tolist() and len(index) == sample_size(rate, num_local)
        hit = torch.zeros(num_local)
        hit[index] = 1.0
        counts += hit
        pairs += hit[:, None] * hit[None]
    count, free = sample_size(rate, num_local) - 1, num_local - 1
    freq = torch.cat([counts[:positive], counts[positive + 1:]]) / trials
    p = count / free
    assert (freq - p).abs().max() < 4 * math.sqrt(p * (1 - p) / trials), freq
    others = [k for k in range(num_local) if k != positive]
    pair = pairs[others][:, others] / trials
    off = ~torch.eye(free, dtype=torch.bool)
    q = p * (count - 1) / (free - 1)
    assert (pair[off] - q).abs().max() < 4.5 * math.sqrt(q * (1 - q) / trials), pair
