"""Verification metrics on embeddings built to have known cosine scores."""

from __future__ import annotations

import numpy as np
import pytest

from partial_fc.eval.ijb import evaluate_ijb
from partial_fc.eval.verification import (
    FARS,
    best_threshold,
    cosine_scores,
    evaluate_pairs,
    resolves,
)


def _pairs_with_scores(scores) -> tuple[np.ndarray, np.ndarray]:
    """2-D unit embeddings whose pairwise cosine is exactly ``scores`` (up to rounding)."""
    s = np.asarray(scores, dtype=np.float64)
    emb1 = np.tile([[3.0, 0.0]], (len(s), 1))  # un-normalised on purpose
    emb2 = np.stack([s, np.sqrt(1 - s**2)], axis=1) * 0.5
    return emb1, emb2


def test_cosine_scores_recovers_scores():
    s = np.array([0.9, -0.3, 0.0, 1.0])
    np.testing.assert_allclose(cosine_scores(*_pairs_with_scores(s)), s, atol=1e-12)


def test_best_threshold_by_hand():
    # t=0.85 -> 3/4 correct, t=0.65 -> 3/4 too; ties go to the higher threshold.
    scores = np.array([0.9, 0.8, 0.7, 0.6])
    same = np.array([True, False, True, False])
    t, acc = best_threshold(scores, same)
    assert t == pytest.approx(0.85) and acc == 0.75
    # Separable with ties inside a class: any t in (0.2, 0.8) is perfect; midpoint 0.5.
    t, acc = best_threshold(np.array([0.8, 0.8, 0.2, 0.2]), np.array([1, 1, 0, 0], bool))
    assert t == pytest.approx(0.5) and acc == 1.0


def test_ten_fold_accuracy_by_hand():
    # 20 pairs, alternating same/different; folds are pairs (0,1), (2,3), ...
    # Positives score 0.8 except pair 0 (0.1); negatives score 0.2. Every fold's
    # training threshold is 0.5, so fold 0 scores 1/2 and the others 2/2:
    # mean 0.95, std sqrt((0.45² + 9·0.05²)/10) = 0.15; AUC = 90/100.
    same = np.arange(20) % 2 == 0
    scores = np.where(same, 0.8, 0.2)
    scores[0] = 0.1
    out = evaluate_pairs(*_pairs_with_scores(scores), same, nfolds=10)
    assert out["accuracy"] == pytest.approx(0.95)
    assert out["accuracy_std"] == pytest.approx(0.15)
    assert out["best_threshold"] == pytest.approx(0.5)
    assert out["auc"] == pytest.approx(0.9)
    assert out["num_pairs"] == 20 and isinstance(out["num_pairs"], int)
    # 10 negatives cannot resolve FAR 1e-3: the closest ROC point is FPR 0, TPR 9/10.
    assert out["impostor_pairs"] == 10 and not resolves(10, 1e-3) and resolves(1000, 1e-3)
    assert out["tar@far=1e-03"] == pytest.approx(0.9)


def test_tar_at_far_by_hand():
    # 10 000 negatives at 0.5, 0.4999, ...; positives: 30 at 0.9, 20 just below the
    # top negative, 10 below the 6th negative, 40 at 0 -> TAR@1e-4 = 0.5, TAR@1e-3 = 0.6.
    neg = 0.5 - np.arange(10_000) * 1e-4
    pos = np.concatenate([np.full(30, 0.9), np.full(20, 0.49995), np.full(10, 0.49945),
                          np.zeros(40)])
    scores = np.concatenate([pos, neg])
    same = np.concatenate([np.ones(len(pos), bool), np.zeros(len(neg), bool)])
    out = evaluate_pairs(*_pairs_with_scores(scores), same)
    assert out["tar@far=1e-04"] == pytest.approx(0.5)
    assert out["tar@far=1e-03"] == pytest.approx(0.6)


def _closest_far_case():
    """1800 negatives (FARs k/1800) and 100 positives: 10 above every negative, 10 between
    the 1st and 2nd, 10 between the 2nd and 3rd, 70 below all. FAR 1e-3 is closest to
    2/1800 (1.11e-3, TAR 0.3), not 1/1800 (0.56e-3, TAR 0.2, the highest TAR at FAR <= 1e-3
    that verification used before the rules were made one)."""
    neg = 0.5 - np.arange(1800) * 1e-4
    pos = np.concatenate([np.full(10, 0.9), np.full(10, 0.49995), np.full(10, 0.49985),
                          np.zeros(70)])
    same = np.concatenate([np.ones(len(pos), bool), np.zeros(len(neg), bool)])
    return np.concatenate([pos, neg]), same


def test_tar_at_far_is_the_closest_far_rule():
    scores, same = _closest_far_case()
    out = evaluate_pairs(*_pairs_with_scores(scores), same)
    assert out["tar@far=1e-03"] == pytest.approx(0.3)


def test_bin_sets_and_ijb_share_the_rule():
    # The same pair scores through IJB's path (one single-image template per pair side).
    scores, same = _closest_far_case()
    emb1, emb2 = _pairs_with_scores(scores)
    p = len(scores)
    ids = np.arange(2 * p)
    ijb = evaluate_ijb(np.concatenate([emb1, emb2]), ids, ids, None, ids[:p], ids[p:], same,
                       fars=FARS)
    pairs = evaluate_pairs(emb1, emb2, same)
    for far in FARS:
        key = f"tar@far={far:.0e}"
        assert ijb[key] == pytest.approx(pairs[key]), key
    assert ijb["num_pairs"] == pairs["num_pairs"] == p
    assert ijb["impostor_pairs"] == pairs["impostor_pairs"] == 1800


def test_matches_brute_force_on_random_scores():
    rng = np.random.default_rng(0)
    same = rng.random(300) < 0.5
    scores = np.round(np.where(same, 0.3, 0.0) + rng.normal(0, 0.2, 300), 2)  # with ties
    for lo in (0, 150):
        s, y = scores[lo:lo + 150], same[lo:lo + 150]
        t, acc = best_threshold(s, y)
        cands = np.concatenate([np.unique(s), [np.inf]])
        brute = max(np.mean((s >= c) == y) for c in cands)
        assert acc == pytest.approx(brute) and np.mean((s >= t) == y) == pytest.approx(acc)


@pytest.mark.parametrize(
    ("issame", "match"),
    [([True] * 4, "both same and different"), ([True, False], "2 entries for 4 pairs")],
)
def test_bad_input(issame, match):
    with pytest.raises(ValueError, match=match):
        evaluate_pairs(*_pairs_with_scores([0.1, 0.2, 0.3, 0.4]), issame, nfolds=2)


def test_fold_thresholds_come_from_the_other_folds_only():
    """Brute-force LFW protocol on random scores: fold k is scored at the best threshold of
    the other nine folds (highest one among ties). Choosing it on all pairs, or on the fold
    itself, gives other numbers on this data."""
    rng = np.random.default_rng(3)
    same = rng.random(200) < 0.5
    scores = np.round(np.where(same, 0.25, 0.0) + rng.normal(0, 0.2, 200), 3)
    folds = np.array_split(np.arange(200), 10)
    accs = []
    for k, test in enumerate(folds):
        train = np.concatenate([f for j, f in enumerate(folds) if j != k])
        s, y = scores[train], same[train]
        u = np.unique(s)  # documented candidates: midpoints of adjacent scores, and the ends
        cands = [u[0] - 1.0, *((u[:-1] + u[1:]) / 2), u[-1] + 1.0]
        t = max(cands, key=lambda c: (np.mean((s >= c) == y), c))
        accs.append(np.mean((scores[test] >= t) == same[test]))
    out = evaluate_pairs(*_pairs_with_scores(scores), same, nfolds=10)
    assert out["accuracy"] == pytest.approx(np.mean(accs), abs=1e-9)
    assert out["accuracy_std"] == pytest.approx(np.std(accs), abs=1e-9)
