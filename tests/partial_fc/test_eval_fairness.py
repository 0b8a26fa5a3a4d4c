"""RFW's per-group summary, by hand."""

from __future__ import annotations

import pytest

from partial_fc.eval.fairness import group_summary


def test_group_summary_by_hand():
    # Mean .875; deviations .025 .075 .075 .025 -> sample variance (ddof=1, TFace's)
    # (2 * .000625 + 2 * .005625) / 3 = .0125 / 3, std .0645; gap .95 - .80 = .15.
    out = group_summary({"African": 0.90, "Asian": 0.80, "Caucasian": 0.95, "Indian": 0.85})
    assert out == pytest.approx({"mean": 0.875, "std": (0.0125 / 3) ** 0.5, "gap": 0.15,
                                 "worst_group": "Asian", "best_group": "Caucasian"})
    assert group_summary({"African": 0.9})["std"] == 0.0
    with pytest.raises(ValueError, match="at least one group"):
        group_summary({})
