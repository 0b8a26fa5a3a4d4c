"""IJB 1:N identification (insightface's ijb_1n.py rules) on hand-computed vectors."""

from __future__ import annotations

import numpy as np
import pytest

from partial_fc.eval.ijb_1n import identification, mated_gallery_index


def test_identification_by_hand():
    # Gallery g0 (1,0), g1 (0,1), g2 (-1,0). Probe p0 (1,0) mate g0: sims 1, 0, -1 -> rank 1.
    # p1 (.8,.6) mate g1: sims .8, .6, -.8 -> rank 2. p2 (.28,.96) mate g1: .28, .96, -.28
    # -> rank 1. Non-mated scores, descending: .8 .28 0 -.28 -.8 -1. FPIR .3: ceil(.9) = 1st
    # -> .8, mated 1 .6 .96 above it: 2/3. FPIR .6: ceil(1.8) = 2nd -> .28: all three.
    gallery = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    probes = np.array([[1.0, 0.0], [0.8, 0.6], [0.28, 0.96]])
    np.testing.assert_array_equal(mated_gallery_index([7, 9, 9], [7, 9, 4]), [0, 1, 1])
    out = identification(probes, [7, 9, 9], gallery, [7, 9, 4], fpirs=(0.3, 0.6),
                         ranks=(1, 2))
    assert out == pytest.approx({"rank1": 2 / 3, "rank2": 1.0, "tpir@fpir=3e-01": 2 / 3,
                                 "tpir@fpir=6e-01": 1.0, "num_probes": 3, "gallery_size": 3})


def test_probe_subject_needs_exactly_one_gallery_template():
    with pytest.raises(ValueError, match="probe subject 5 has 0 gallery templates"):
        mated_gallery_index([7, 5], [7, 9])
    with pytest.raises(ValueError, match="probe subject 9 has 2 gallery templates"):
        mated_gallery_index([9], [9, 9])
