"""Streamed top-k search against dense numpy, and the rank rule MegaFace and TinyFace share."""

from __future__ import annotations

import numpy as np
import pytest

from partial_fc.eval.gallery_search import FlatTopK, IvfTopK, rank_of, top_k_search
from partial_fc.eval.megaface import clean_probe_features, megaface_identification


def _unit(x):
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_flat_streamed_equals_dense_top_k():
    rng = np.random.default_rng(0)
    probes, gallery = _unit(rng.standard_normal((7, 16))), _unit(rng.standard_normal((50, 16)))
    search = FlatTopK(probes, k=5)
    for start in range(0, 50, 8):  # chunks of 8, the last of 2; one smaller than k
        search.add(gallery[start:start + 8])
    dense = -np.sort(-(probes @ gallery.T), axis=1)[:, :5]
    np.testing.assert_allclose(search.scores(), dense, atol=1e-6)


def test_flat_pads_with_minus_inf_until_k_rows_seen():
    search = FlatTopK(np.eye(2, dtype=np.float32), k=3)
    search.add(np.array([[1.0, 0.0]], np.float32))
    assert search.scores().tolist() == [[1.0, -np.inf, -np.inf], [0.0, -np.inf, -np.inf]]


def test_ivf_with_every_cell_probed_is_exact():
    rng = np.random.default_rng(1)
    probes, gallery = _unit(rng.standard_normal((5, 8))), _unit(rng.standard_normal((400, 8)))
    search = IvfTopK(probes, k=3, nlist=4, nprobe=4)
    search.add(gallery[:200])
    search.add(gallery[200:])
    dense = -np.sort(-(probes @ gallery.T), axis=1)[:, :3]
    np.testing.assert_allclose(search.scores(), dense, atol=1e-6)
    with pytest.raises(ValueError, match="at least nlist=4 rows, got 2"):
        IvfTopK(probes, k=3, nlist=4).add(gallery[:2])
    with pytest.raises(ValueError, match="unknown gallery index 'hnsw'"):
        top_k_search(probes, 3, "hnsw")


def test_rank_of_counts_ties_for_the_probe():
    top = np.array([[0.9, 0.5, 0.1]])
    assert rank_of(np.array([0.5]), top).tolist() == [2]  # only 0.9 beats it
    assert rank_of(np.array([0.95]), top).tolist() == [1]
    assert rank_of(np.array([0.0]), top).tolist() == [4]  # past k: k + 1


def test_megaface_pairs_by_hand():
    # Identity 0: (1,0), (0.6,0.8); identity 1: (0,1), (-0.6,0.8). Best distractor scores:
    # 0.5, 0.9, 0.7, 0.1. Identity 0: (1,0)·(.6,.8) = .6 >= .9? no (probe 2); >= .5 yes
    # (probe 1). Identity 1: (0,1)·(-.6,.8) = .8 >= .1 yes, >= .7 yes. 3 of 4 pairs.
    feats = np.array([[1, 0], [0.6, 0.8], [0, 1], [-0.6, 0.8]], np.float32)
    top = np.array([[0.5], [0.9], [0.7], [0.1]], np.float32)
    out = megaface_identification(feats, np.array([0, 0, 1, 1]), top)
    assert out == pytest.approx({"rank1": 0.75, "num_probes": 4})
    with pytest.raises(ValueError, match="rank-5 needs the 5 best gallery scores, got 1"):
        megaface_identification(feats, np.array([0, 0, 1, 1]), top, ranks=(1, 5))


def test_noisy_probe_becomes_its_identity_centre():
    feats = np.array([[1, 0], [0, 1], [-1, 0], [0, 1]], np.float32)
    out = clean_probe_features(feats, np.array([0, 0, 0, 1]), np.array([0, 0, 1, 0], bool))
    np.testing.assert_allclose(out, [[1, 0], [0, 1], [0.70710677, 0.70710677], [0, 1]])
    with pytest.raises(ValueError, match="identity 1: every image is listed as noise"):
        clean_probe_features(feats, np.array([0, 0, 0, 1]), np.array([0, 0, 0, 1], bool))
