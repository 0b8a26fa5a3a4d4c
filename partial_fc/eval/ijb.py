"""IJB-B / IJB-C 1:1 verification: template features, pair scores, TAR at FAR.

The protocol as insightface evaluates it (``recognition/_evaluation_/ijb``), so the
numbers compare with published tables:

1. image feature ``f_i``: embedding of the aligned face plus its flip, L2-normalised;
2. detector-score weighting: ``f_i <- q_i · f_i`` with ``q_i`` the face detector score;
3. media pooling: faces of the same media (video frames, or one still) in a
   template are averaged, ``g_m = mean_{i in m} f_i``;
4. template feature: ``t = normalise(sum_{m in template} g_m)``;
5. score of a template pair: cosine ``<t_1, t_2>``;
6. TAR at FAR in 1e-6 .. 1e-1 from ``sklearn.metrics.roc_curve``, taking the ROC
   point whose FAR is *closest* to the target (insightface's rule, the one
   ``partial_fc.eval.verification.tar_at_far`` applies to every set; at a FAR that
   the negative count cannot resolve this is the nearest achievable point).
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import roc_curve

from partial_fc.eval.verification import normalise_rows, tar_at_far

IJB_FARS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


def template_features(
    image_feats, templates, medias, face_scores=None
) -> tuple[np.ndarray, np.ndarray]:
    """Pool image features into unit template features (steps 1-4 above).

    Args:
        image_feats: ``[N, D]`` per-image features (normalised here).
        templates, medias: ``[N]`` integer template and media id of each image.
        face_scores: ``[N]`` detector scores, or None for no weighting.

    Returns:
        ``(template_ids [T] sorted, features [T, D] float64 unit rows)``.
    """
    feats = normalise_rows(np.asarray(image_feats, dtype=np.float64))
    templates = np.asarray(templates)
    medias = np.asarray(medias)
    if not len(feats) == len(templates) == len(medias):
        raise ValueError(f"{len(feats)} features for {len(templates)} templates / "
                         f"{len(medias)} media ids")
    if face_scores is not None:
        feats = feats * np.asarray(face_scores, dtype=np.float64)[:, None]
    # One group per (template, media): sum then divide by the group size.
    pairs = np.stack([templates, medias], axis=1)
    groups, group_of = np.unique(pairs, axis=0, return_inverse=True)
    group_of = group_of.reshape(-1)
    media_feats = np.zeros((len(groups), feats.shape[1]))
    np.add.at(media_feats, group_of, feats)
    media_feats /= np.bincount(group_of, minlength=len(groups))[:, None]
    template_ids, template_of = np.unique(groups[:, 0], return_inverse=True)
    out = np.zeros((len(template_ids), feats.shape[1]))
    np.add.at(out, template_of.reshape(-1), media_feats)
    return template_ids, normalise_rows(out)


def pair_scores(template_ids, template_feats, t1, t2) -> np.ndarray:
    """Cosine of each template pair ``(t1[k], t2[k])``; ``[M]``. Unknown ids raise ValueError."""
    template_ids = np.asarray(template_ids)
    idx = []
    for side in (np.asarray(t1), np.asarray(t2)):
        pos = np.searchsorted(template_ids, side)
        bad = (pos >= len(template_ids)) | (template_ids[np.minimum(pos, len(template_ids) - 1)]
                                            != side)
        if bad.any():
            raise ValueError(f"pair list names template {side[bad][0]} that has no images")
        idx.append(pos)
    return np.einsum("md,md->m", template_feats[idx[0]], template_feats[idx[1]])


def tar_at_far_closest(labels, scores, fars=IJB_FARS) -> dict[float, float]:
    """TAR at the ROC point whose FAR is closest to each target (:func:`tar_at_far`)."""
    fpr, tpr, _ = roc_curve(np.asarray(labels).astype(bool), np.asarray(scores))
    return {far: tar_at_far(fpr, tpr, far) for far in fars}


def evaluate_ijb(image_feats, templates, medias, face_scores, t1, t2, labels,
                 fars=IJB_FARS) -> dict[str, float | int]:
    """Steps 1-6 for ``[N]`` images and ``[M]`` labelled template pairs.

    Returns:
        ``{"tar@far=1e-06": ..., ..., "tar@far=1e-01": ..., "num_pairs": M,
        "impostor_pairs": negatives}`` (the counts are integers).
        ``face_scores=None`` disables detector-score weighting.
    """
    ids, feats = template_features(image_feats, templates, medias, face_scores)
    scores = pair_scores(ids, feats, t1, t2)
    out: dict[str, float | int] = {f"tar@far={far:.0e}": tar for far, tar in
                                   tar_at_far_closest(labels, scores, fars).items()}
    out["num_pairs"] = len(scores)
    out["impostor_pairs"] = int((~np.asarray(labels).astype(bool)).sum())
    return out
