"""Closed-set identification by image: cumulative match characteristic (CMC) at rank k.

TinyFace's protocol (Cheng et al., ACCV 2018, its released evaluation code): every probe
image is compared with every gallery image (its identity's matched images plus
distractors); rank-k is the share of probes for which an image of their identity is among
the ``k`` most similar gallery images. Similarity is the cosine of unit features, which
ranks like the released code's Euclidean distance. Ties are counted in the probe's favour
(an image as similar as the best mate does not push it down).

A gallery too large to score densely (TinyFace's 153,428 distractors) is searched apart,
streamed through :mod:`partial_fc.eval.gallery_search`, and comes in as each probe's best
distractor scores (``distractor_top``); they count as non-mates.
"""

from __future__ import annotations

import numpy as np

from partial_fc.eval.gallery_search import check_depth, rank_of

TINYFACE_RANKS = (1, 5, 20)


def cmc(probe_feats, probe_ids, gallery_feats, gallery_ids, ranks=TINYFACE_RANKS,
        chunk: int = 1024, distractor_top: np.ndarray | None = None,
        distractors: int = 0) -> dict[str, float | int]:
    """Rank-k of unit ``[P, D]`` probes against unit ``[G, D]`` gallery rows, and against
    ``distractors`` more rows given as each probe's best scores ``distractor_top``
    ``[P, K]`` (``K >= max(ranks)``, descending; None: no distractors).

    ``chunk`` probes are scored at a time, so memory is ``chunk x G`` float64s (float64:
    cosines of near-identical faces differ past float32's 6e-8, and ijb_1n.py ranks in
    float64).

    Returns:
        ``{"rank1": ..., "rank5": ..., "rank20": ..., "num_probes": P,
        "gallery_size": G + distractors}``.
        A probe whose identity has no gallery image raises ValueError.
    """
    if distractor_top is not None:
        check_depth(distractor_top, ranks)
    probe_ids, gallery_ids = np.asarray(probe_ids), np.asarray(gallery_ids)
    gallery = np.asarray(gallery_feats, np.float64)
    positions = []
    for start in range(0, len(probe_ids), chunk):
        sims = np.asarray(probe_feats[start:start + chunk], np.float64) @ gallery.T
        mates = probe_ids[start:start + chunk, None] == gallery_ids[None, :]
        lonely = ~mates.any(axis=1)
        if lonely.any():
            raise ValueError(f"probe identity {probe_ids[start + np.argmax(lonely)]} has no "
                             "gallery image")
        best_mate = np.where(mates, sims, -np.inf).max(axis=1)
        position = 1 + (sims > best_mate[:, None]).sum(axis=1)
        if distractor_top is not None:
            position += rank_of(best_mate, distractor_top[start:start + chunk]) - 1
        positions.append(position)
    position = np.concatenate(positions)
    out: dict[str, float | int] = {f"rank{k}": float((position <= k).mean()) for k in ranks}
    out["num_probes"], out["gallery_size"] = len(probe_ids), len(gallery_ids) + distractors
    return out
