"""Pair verification metrics on embeddings (the LFW / insightface ``.bin`` protocol).

Pairs are scored by cosine similarity of the L2-normalised embeddings (for unit
vectors ``||a - b||² = 2 - 2 cos``, so this ranks pairs exactly like insightface's
squared-distance code); "same" is predicted when ``score >= threshold``.

Accuracy follows the standard unrestricted LFW protocol as insightface computes
it: the pairs are cut into ``nfolds`` consecutive folds (``KFold``, no shuffle);
for each fold the threshold maximising accuracy on the other folds is applied to
it. Unlike insightface's fixed threshold grid (step 0.01 in distance), the
threshold here is the exact optimum: the midpoint between adjacent distinct
training scores, so results do not depend on a grid resolution.
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import auc, roc_curve
from sklearn.model_selection import KFold

FARS = (1e-3, 1e-4)


def normalise_rows(x: np.ndarray) -> np.ndarray:
    """Unit L2 rows of ``[N, D]`` (rows of norm below 1e-12 are divided by 1e-12)."""
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def cosine_scores(emb1, emb2) -> np.ndarray:
    """Cosine similarity per row: ``[P, D], [P, D] -> [P]`` float64 (inputs need not be unit)."""
    a = np.asarray(emb1, dtype=np.float64)
    b = np.asarray(emb2, dtype=np.float64)
    if a.ndim != 2 or a.shape != b.shape:
        raise ValueError(f"embedding shapes must be equal [P, D], got {a.shape} and {b.shape}")
    return np.einsum("pd,pd->p", normalise_rows(a), normalise_rows(b))


def best_threshold(scores: np.ndarray, issame: np.ndarray) -> tuple[float, float]:
    """Threshold maximising the accuracy of ``score >= t`` on these pairs.

    Candidates are midpoints between adjacent distinct scores plus one value below
    the minimum and one above the maximum; ties go to the highest threshold.

    Returns:
        ``(threshold, accuracy)``.
    """
    values = np.unique(scores)  # ascending
    cuts = np.concatenate(([values[0] - 1.0], (values[:-1] + values[1:]) / 2, [values[-1] + 1.0]))
    # Pairs with score < cut k are exactly those with score <= values[k-1].
    below = np.searchsorted(values, scores, side="left")  # index of each score in values
    pos_below = np.bincount(below[issame], minlength=len(values)).cumsum()
    neg_below = np.bincount(below[~issame], minlength=len(values)).cumsum()
    n_pos = int(issame.sum())
    # correct(cut k) = negatives below + positives at or above.
    neg_lt = np.concatenate(([0], neg_below))
    pos_lt = np.concatenate(([0], pos_below))
    correct = neg_lt + (n_pos - pos_lt)
    k = len(correct) - 1 - int(np.argmax(correct[::-1]))
    return float(cuts[k]), float(correct[k] / len(scores))


def tar_at_far(fpr: np.ndarray, tpr: np.ndarray, far: float) -> float:
    """True-accept rate at the ROC point whose false-accept rate is closest to ``far``.

    The IJB protocol's rule (insightface ``recognition/_evaluation_/ijb``), used for every
    TAR@FAR this project reports (``.bin`` sets and IJB alike), so the columns compare. Ties
    go to the larger FAR, as insightface's ``min(zip(|fpr - far|, index))`` over the flipped
    ROC. With fewer than ``1/far`` impostor pairs no ROC point lies at ``far``: the value is
    the nearest achievable point (:func:`resolves` says which; reports mark it).
    """
    fpr, tpr = np.asarray(fpr)[::-1], np.asarray(tpr)[::-1]
    return float(tpr[int(np.argmin(np.abs(fpr - far)))])


def resolves(impostor_pairs: int, far: float) -> bool:
    """Whether ``impostor_pairs`` different-identity pairs can measure a FAR of ``far``
    (at least one false accept allowed: ``impostor_pairs * far >= 1``)."""
    return impostor_pairs * far >= 1.0


def evaluate_pairs(emb1, emb2, issame, nfolds: int = 10) -> dict[str, float | int]:
    """Verification metrics for P pairs ``(emb1[p], emb2[p])``.

    Args:
        emb1, emb2: ``[P, D]`` embeddings (numpy or CPU tensors); normalised here.
        issame: ``[P]`` bools, True for a same-identity pair. Both kinds must occur.
        nfolds: folds for the accuracy (10 is the LFW protocol).

    Returns:
        A flat dict of floats: ``accuracy`` and ``accuracy_std`` (mean and std over
        the folds, each fold scored at the threshold chosen on the other folds),
        ``best_threshold`` (best cosine threshold on all pairs), ``auc`` (ROC area),
        ``tar@far=1e-03`` / ``tar@far=1e-04`` (:func:`tar_at_far`; with fewer than 1/FAR
        ``impostor_pairs`` the nearest achievable FAR, see :func:`resolves`), and the
        integers ``num_pairs`` and ``impostor_pairs`` (different-identity pairs).
    """
    scores = cosine_scores(emb1, emb2)
    same = np.asarray(issame, dtype=bool).reshape(-1)
    if same.shape[0] != scores.shape[0]:
        raise ValueError(f"issame has {same.shape[0]} entries for {scores.shape[0]} pairs")
    n_neg = int((~same).sum())
    if same.all() or n_neg == len(same):
        raise ValueError("verification needs both same and different pairs")
    if not 2 <= nfolds <= len(same):
        raise ValueError(f"nfolds must be in [2, {len(same)}], got {nfolds}")

    fold_acc = []
    for train, test in KFold(n_splits=nfolds, shuffle=False).split(scores):
        t, _ = best_threshold(scores[train], same[train])
        fold_acc.append(np.mean((scores[test] >= t) == same[test]))
    threshold, _ = best_threshold(scores, same)
    fpr, tpr, _ = roc_curve(same, scores)
    out = {
        "accuracy": float(np.mean(fold_acc)),
        "accuracy_std": float(np.std(fold_acc)),
        "best_threshold": threshold,
        "auc": float(auc(fpr, tpr)),  # what roc_auc_score computes, from this ROC
        "num_pairs": len(same),
        "impostor_pairs": n_neg,
    }
    out.update({f"tar@far={far:.0e}": tar_at_far(fpr, tpr, far) for far in FARS})
    return out
