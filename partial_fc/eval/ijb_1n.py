"""IJB-B / IJB-C 1:N identification: rank-k and TPIR at FPIR of mixed-media probe templates.

As insightface's ``recognition/_evaluation_/ijb/ijb_1n.py`` computes it:

- templates are pooled exactly as for 1:1 (:func:`partial_fc.eval.ijb.template_features`:
  flip-summed image features, norm kept, detector-score weighted, media-averaged,
  template-summed, normalised);
- the gallery is both galleries together (G1 + G2 for IJB-C, S1 + S2 for IJB-B), one
  template per subject, so every probe has exactly one mated gallery template (a probe
  subject found zero or several times is an error, as in ``gen_mask``): a closed set;
- rank-k: the share of probes whose mated template is among the ``k`` gallery templates
  of highest cosine;
- TPIR at FPIR ``f``: the threshold is the ``ceil(P · f)``-th largest *non-mated* score
  over all ``P × (G - 1)`` probe-gallery pairs, and TPIR is the share of probes whose
  mated score exceeds it (strictly). ``ijb_1n.py`` prints FPIR 1e-2 and 1e-1; 1e-3 is
  the same rule. This is insightface's rule, not NIST's (which counts only each
  probe's top non-mated score and requires the mate at rank 1); the numbers compare
  with papers that use insightface's script.
"""

from __future__ import annotations

import math

import numpy as np

from partial_fc.eval.ranking import cmc

FPIRS = (1e-3, 1e-2, 1e-1)
RANKS = (1, 5, 10)


def mated_gallery_index(probe_subjects, gallery_subjects) -> np.ndarray:
    """``[P]`` index of each probe's subject in ``gallery_subjects``; ValueError unless
    exactly one gallery template holds it."""
    gallery_subjects = np.asarray(gallery_subjects)
    out = []
    for subject in np.asarray(probe_subjects):
        (hits,) = np.nonzero(gallery_subjects == subject)
        if len(hits) != 1:
            raise ValueError(f"probe subject {subject} has {len(hits)} gallery templates "
                             "(1:N needs exactly one)")
        out.append(hits[0])
    return np.asarray(out, dtype=np.int64)


def identification(probe_feats, probe_subjects, gallery_feats, gallery_subjects,
                   fpirs=FPIRS, ranks=RANKS) -> dict[str, float | int]:
    """Rank-k and TPIR@FPIR of unit ``[P, D]`` probes against unit ``[G, D]`` gallery rows.

    Each probe's mate is the gallery row of its subject (:func:`mated_gallery_index`);
    rank-k is :func:`partial_fc.eval.ranking.cmc` with one gallery row per subject.

    Returns:
        ``{"rank1": ..., "rank5": ..., "rank10": ..., "tpir@fpir=1e-03": ..., ...,
        "num_probes": P, "gallery_size": G}``.
    """
    mated = mated_gallery_index(probe_subjects, gallery_subjects)
    out = cmc(probe_feats, probe_subjects, gallery_feats, gallery_subjects, ranks)
    sims = np.asarray(probe_feats, np.float64) @ np.asarray(gallery_feats, np.float64).T
    rows = np.arange(len(sims))
    mated_sims = sims[rows, mated]
    non_mated = sims.copy()
    non_mated[rows, mated] = -np.inf
    non_mated = np.sort(non_mated.reshape(-1))[::-1]
    for fpir in fpirs:
        threshold = non_mated[math.ceil(len(sims) * fpir) - 1]
        out[f"tpir@fpir={fpir:.0e}"] = float((mated_sims > threshold).mean())
    return out
