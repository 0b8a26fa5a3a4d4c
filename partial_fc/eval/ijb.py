"""IJB-B / IJB-C 1:1 verification: template features, pair scores, TAR at FAR.

The protocol as insightface's ``recognition/arcface_torch/eval_ijbc.py`` scores it
(``use_norm_score = use_detector_score = use_flip_test = True``; bench/ijb_equivalence.py
runs that script next to this code on the same folder):

1. image feature ``f_i = e(x_i) + e(flip(x_i))``, the embeddings of the aligned face
   and its mirror summed and *not* normalised: the norm stays a quality weight
   (eval_ijbc.py's "TestMode(N1)"). ``image_norm="unit"`` L2-normalises ``f_i``
   first instead, eval_ijbc.py's ``use_norm_score = False``;
2. detector-score weighting: ``f_i <- q_i · f_i`` with ``q_i`` the face detector score;
3. media pooling: faces of the same media (video frames, or one still) in a
   template are averaged, ``g_m = mean_{i in m} f_i``;
4. template feature: ``t = normalise(sum_{m in template} g_m)``;
5. score of a template pair: cosine ``<t_1, t_2>``;
6. TAR at FAR in 1e-6 .. 1e-1 from ``sklearn.metrics.roc_curve``, taking the ROC
   point whose FAR is *closest* to the target (insightface's rule, the one
   ``partial_fc.eval.verification.tar_at_far`` applies to every set; at a FAR that
   the negative count cannot resolve this is the nearest achievable point).

The pooling runs in float64; eval_ijbc.py pools in float32, a difference of ~1e-7 in
the scores.
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import roc_curve

from partial_fc.eval.verification import normalise_rows, tar_at_far

IJB_FARS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
# How image features enter the pooling (step 1): "kept" is eval_ijbc.py's default.
IMAGE_NORMS = ("kept", "unit")


def template_features(
    image_feats, templates, medias, face_scores=None, image_norm: str = "kept"
) -> tuple[np.ndarray, np.ndarray]:
    """Pool image features into unit template features (steps 1-4 above).

    Args:
        image_feats: ``[N, D]`` per-image features, flip-summed, unnormalised.
        templates, medias: ``[N]`` integer template and media id of each image.
        face_scores: ``[N]`` detector scores, or None for no weighting.
        image_norm: ``"kept"`` (the feature norm weights the image) or ``"unit"``
            (each image feature L2-normalised first).

    Returns:
        ``(template_ids [T] sorted, features [T, D] float64 unit rows)``.
    """
    if image_norm not in IMAGE_NORMS:
        raise ValueError(f"image_norm {image_norm!r}: choose one of {', '.join(IMAGE_NORMS)}")
    feats = np.asarray(image_feats, dtype=np.float64)
    if image_norm == "unit":
        feats = normalise_rows(feats)
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
                 fars=IJB_FARS, image_norm: str = "kept") -> dict[str, float | int]:
    """Steps 1-6 for ``[N]`` images and ``[M]`` labelled template pairs.

    Returns:
        ``{"tar@far=1e-06": ..., ..., "tar@far=1e-01": ..., "num_pairs": M,
        "impostor_pairs": negatives}`` (the counts are integers).
        ``face_scores=None`` disables detector-score weighting.
    """
    ids, feats = template_features(image_feats, templates, medias, face_scores, image_norm)
    scores = pair_scores(ids, feats, t1, t2)
    out: dict[str, float | int] = {f"tar@far={far:.0e}": tar for far, tar in
                                   tar_at_far_closest(labels, scores, fars).items()}
    out["num_pairs"] = len(scores)
    out["impostor_pairs"] = int((~np.asarray(labels).astype(bool)).sum())
    return out
