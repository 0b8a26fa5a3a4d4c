"""The overlap's search: which centre is nearest each probe (open-set identification).

Both modes ask it. ``launch.overlap`` searches each evaluation image against the training
centres (``offline.overlap.matches``), the calibration searches each null probe against the
centres of every *other* identity (:func:`best_other_centre`), and ``launch.overlap
--between`` searches each centre against the other sets' (``offline.overlap.pairs``). The
search is the exact flat search of ``partial_fc.eval.gallery_search``, the centres streamed
in chunks of :data:`CENTRE_CHUNK`, so that a gallery of millions of centres costs the
probes' ``[P, k]`` results and faiss's tiles, never ``[P, C]``.
"""

from __future__ import annotations

import numpy as np

from partial_fc.eval.gallery_search import FlatTopK

SEARCH_BLOCK = 2048  # probes (images or centres) embedded, then searched, together (per rank)
CENTRE_CHUNK = 65_536  # centres per faiss call: the chunk's scores are [probes, k] only


def centre_search(probes: np.ndarray, centres: np.ndarray, k: int = 1
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` nearest centres of each probe: cosines ``[P, k]`` float32 and labels
    ``[P, k]`` int64, best first (of equal cosines, the lower label). ``probes`` ``[P, D]``
    and ``centres`` ``[C, D]`` unit rows; memory: the probes, ``[P, k]`` and faiss's tiles."""
    search = FlatTopK(probes, k)
    for start in range(0, len(centres), CENTRE_CHUNK):
        search.add(centres[start:start + CENTRE_CHUNK])
    return search.scores(), search.ids()


def best_other_centre(probes: np.ndarray, labels: np.ndarray, centres: np.ndarray
                      ) -> np.ndarray:
    """``max_{c != labels[i]} cos(probes[i], centres[c])`` ``[P]``: the second of the two
    nearest where the nearest is the probe's own identity."""
    scores, ids = centre_search(probes, centres, 2)
    return np.where(ids[:, 0] == labels, scores[:, 1], scores[:, 0])
