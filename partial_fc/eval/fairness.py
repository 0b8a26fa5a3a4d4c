"""Accuracy by demographic group (RFW): per-group 10-fold accuracy and its spread.

RFW (Racial Faces in-the-Wild, Wang et al., ICCV 2019) holds one 6,000-pair verification set
per group: African, Asian, Caucasian, Indian. As TFace's ``test/verification_rfw.py`` scores
it, each group is an insightface ``.bin`` set evaluated like LFW (10-fold accuracy,
:func:`partial_fc.eval.verification.evaluate_pairs`). The summary is the mean over groups,
the standard deviation (population, ``ddof=0``, numpy's default: the four groups are the
whole set, not a sample) and the gap between the best and the worst group.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

RFW_GROUPS = ("African", "Asian", "Caucasian", "Indian")


def group_summary(accuracy: Mapping[str, float]) -> dict[str, float | str]:
    """``{group: accuracy}`` -> ``{"mean", "std", "gap": best - worst, "worst_group",
    "best_group"}``; at least one group."""
    if not accuracy:
        raise ValueError("group_summary needs at least one group")
    values = np.array(list(accuracy.values()), dtype=np.float64)
    names = list(accuracy)
    return {"mean": float(values.mean()), "std": float(values.std()),
            "gap": float(values.max() - values.min()),
            "worst_group": names[int(values.argmin())], "best_group": names[int(values.argmax())]}
