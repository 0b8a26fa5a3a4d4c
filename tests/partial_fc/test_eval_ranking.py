"""CMC rank-k (TinyFace's protocol) by hand."""

from __future__ import annotations

import numpy as np
import pytest

from partial_fc.eval.ranking import cmc


def test_cmc_by_hand():
    # Gallery: id 1 at (1,0) and (0,1); id 2 at (.6,.8); distractor (-1) at (.8,.6).
    # Probe id 1 at (0,1): its best mate (0,1) scores 1 -> rank 1. Probe id 2 at (1,0):
    # mate .6, beaten by (1,0) (1.0) and the distractor (.8) -> rank 3.
    gallery = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8], [0.8, 0.6]])
    probes = np.array([[0.0, 1.0], [1.0, 0.0]])
    out = cmc(probes, [1, 2], gallery, [1, 1, 2, -1], ranks=(1, 2, 3), chunk=1)
    assert out == pytest.approx({"rank1": 0.5, "rank2": 0.5, "rank3": 1.0, "num_probes": 2,
                                 "gallery_size": 4})
    with pytest.raises(ValueError, match="probe identity 7 has no gallery image"):
        cmc(probes, [1, 7], gallery, [1, 1, 2, -1])
