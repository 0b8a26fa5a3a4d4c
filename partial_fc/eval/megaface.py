"""MegaFace challenge 1 identification: rank-k of FaceScrub against 10^k distractors.

The protocol (Kemelmacher-Shlizerman et al., CVPR 2016) as its devkit scores it and as
insightface's ``recognition/_evaluation_/megaface/`` feeds it: for every FaceScrub identity
with ``M`` images, each image in turn joins the distractors as the one gallery mate and each of
the other ``M - 1`` images is a probe. A (mate, probe) pair counts at rank ``k`` when the mate
scores at least the probe's ``k``-th best distractor (ties in the probe's favour, as the
devkit's Python twin in FaceX-Zoo, ``test_protocol/megaface/megaface_evaluator.py``, counts
them). Rank-k is the share of all ``sum M (M - 1)`` ordered pairs that count. Features are unit
(flip-summed, normalised: ``gen_megaface.py``); the score is their inner product.

insightface's ``remove_noises.py`` then cleans the labels:

- a distractor listed as noise (it shows a FaceScrub identity) gets a 513th dimension of 100
  so that its L2 distance to every probe exceeds 100: it is never ranked above a mate. Here
  it is left out of the search and still counted in the 10^k.
- a FaceScrub image listed as noise is replaced by the normalised mean of its identity's clean
  features plus uniform noise in [-0.001, 0.001] per dimension before normalising; here the
  normalised mean without the random noise (which moves a cosine by ~1e-5 and makes the
  reference unrepeatable).
"""

from __future__ import annotations

import numpy as np

from partial_fc.eval.gallery_search import check_depth, rank_of

MEGAFACE_SIZES = (10, 100, 1_000, 10_000, 100_000, 1_000_000)
# The references read: insightface's recognition/_evaluation_/megaface/ at bench/
# ijb_equivalence.py's INSIGHTFACE_COMMIT; FaceX-Zoo's test_protocol/megaface/ at this one.
FACEX_ZOO_COMMIT = "f8f3cf1e7502325d1891c5cc6ad4ce0c1a653145"


def clean_probe_features(feats: np.ndarray, identities: np.ndarray,
                         noisy: np.ndarray) -> np.ndarray:
    """``[P, D]`` unit features with each noisy row replaced by its identity's normalised
    mean of clean rows (``remove_noises.py``'s centre). An identity whose images are all
    noisy raises ValueError (the reference asserts it has a centre)."""
    out = np.array(feats, np.float32, copy=True)
    for identity in np.unique(identities[noisy]):
        rows = identities == identity
        clean = rows & ~noisy
        if not clean.any():
            raise ValueError(f"FaceScrub identity {identity}: every image is listed as noise")
        centre = out[clean].sum(axis=0)
        out[rows & noisy] = centre / np.linalg.norm(centre)
    return out


def megaface_identification(feats: np.ndarray, identities: np.ndarray,
                            distractor_top: np.ndarray,
                            ranks: tuple[int, ...] = (1,)) -> dict[str, float | int]:
    """Rank-k of unit FaceScrub ``feats`` ``[P, D]`` given each image's best distractor
    scores ``distractor_top`` ``[P, K]`` (descending, ``K >= max(ranks)``).

    Returns:
        ``{"rank1": ..., "num_probes": ordered (mate, probe) pairs}``.
    """
    check_depth(distractor_top, ranks)
    hits = np.zeros(len(ranks), np.int64)
    pairs = 0
    for identity in np.unique(identities):
        rows = np.flatnonzero(identities == identity)
        scores = feats[rows] @ feats[rows].T  # [mate, probe]
        position = rank_of(scores, distractor_top[rows][None, :, :])
        off_diagonal = ~np.eye(len(rows), dtype=bool)
        hits += [(position[off_diagonal] <= k).sum() for k in ranks]
        pairs += int(off_diagonal.sum())
    if pairs == 0:
        raise ValueError("no FaceScrub identity has two images: MegaFace needs mate/probe pairs")
    out: dict[str, float | int] = {f"rank{k}": float(h / pairs) for k, h in zip(ranks, hits,
                                                                                strict=True)}
    out["num_probes"] = pairs
    return out
