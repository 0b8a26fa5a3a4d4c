"""Accuracy by demographic group (RFW): per-group 10-fold accuracy and its spread.

RFW (Racial Faces in-the-Wild, Wang et al., ICCV 2019) holds one 6,000-pair verification set
per group: African, Asian, Caucasian, Indian. TFace's ``recognition/test/verification_rfw.py``
scores each group like LFW, with its own threshold rule (:func:`tface_accuracy`), and
summarises the four accuracies by their mean and their standard deviation with ``ddof=1``
(``np.std(100 * accuracies, ddof=1)``: the sample deviation, in percent there, a fraction
here). The gap between the best and the worst group is added.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from sklearn.model_selection import KFold

from partial_fc.eval.verification import normalise_rows

RFW_GROUPS = ("African", "Asian", "Caucasian", "Indian")
# The reference read and matched: recognition/test/verification_rfw.py and utils.py there.
TFACE_COMMIT = "171ec1434aca0972e111663ac646c9c1e3e44b5b"
# TFace's rfw_evaluate: thresholds on the *squared L2 distance* of unit features, which lies
# in [0, 4]; its grid stops below 1, so "same" is predicted only for cosines above ~0.5.
TFACE_THRESHOLDS = np.arange(-1, 1, 0.001)
THRESHOLD_RULES = ("tface", "exact")


def tface_accuracy(emb1, emb2, issame, nfolds: int = 10) -> dict[str, float]:
    """10-fold accuracy as TFace's ``rfw_evaluate``/``calculate_roc`` compute it.

    Pairs ``[P, D]`` are normalised; ``dist = ||a - b||^2``; "same" when
    ``dist < t``; per fold (``KFold``, no shuffle) ``t`` is the first grid value of
    :data:`TFACE_THRESHOLDS` with the best accuracy on the other folds. This grid caps ``t``
    at 0.999 (cosine 0.5005), unlike insightface's ``np.arange(0, 4, 0.01)``: a model whose
    best threshold lies at a lower cosine scores lower here than under the exact rule.

    Returns:
        ``{"accuracy", "accuracy_std" (ddof=0 over folds, as TFace prints it),
        "best_threshold": the cosine 1 - t/2 of the fold thresholds' mean}``.
    """
    a = normalise_rows(np.asarray(emb1, np.float64))
    b = normalise_rows(np.asarray(emb2, np.float64))
    dist = np.sum(np.square(a - b), axis=1)
    same = np.asarray(issame, bool)
    accuracy, chosen = [], []
    for train, test in KFold(n_splits=nfolds, shuffle=False).split(dist):
        correct = (dist[train][None, :] < TFACE_THRESHOLDS[:, None]) == same[train][None, :]
        t = TFACE_THRESHOLDS[int(np.argmax(correct.mean(axis=1)))]
        accuracy.append(np.mean((dist[test] < t) == same[test]))
        chosen.append(t)
    return {"accuracy": float(np.mean(accuracy)), "accuracy_std": float(np.std(accuracy)),
            "best_threshold": float(1 - np.mean(chosen) / 2)}


def group_summary(accuracy: Mapping[str, float]) -> dict[str, float | str]:
    """``{group: accuracy}`` -> ``{"mean", "std" (ddof=1, TFace's; 0 for one group), "gap":
    best - worst, "worst_group", "best_group"}``; at least one group."""
    if not accuracy:
        raise ValueError("group_summary needs at least one group")
    values = np.array(list(accuracy.values()), dtype=np.float64)
    names = list(accuracy)
    return {"mean": float(values.mean()),
            "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
            "gap": float(values.max() - values.min()),
            "worst_group": names[int(values.argmin())], "best_group": names[int(values.argmax())]}
