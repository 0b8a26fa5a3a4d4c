"""The ``k`` most similar gallery rows of each probe, over a gallery streamed in chunks.

MegaFace ranks FaceScrub probes against up to 10^6 distractors, TinyFace against 153,428. The
gallery is never held whole: chunks of unit rows are fed to :meth:`add` as they are embedded,
each is searched by faiss (exact inner product, ``IndexFlatIP``'s kernel) and merged into a
running ``[P, k]`` table, so memory is one chunk plus ``P x k`` floats.

``IvfTopK`` is the approximate alternative (``IndexIVFFlat``): it must hold every row (4 bytes x
D per row) and trains its coarse quantiser on the first chunk, and it misses a neighbour that
falls outside the ``nprobe`` searched cells. The protocols' published numbers are exact
searches, so evaluation uses :class:`FlatTopK`; ``bench/gallery_search.py`` measures where
the IVF one starts to pay (docs/benchmarks.md).

Scores are float32 (faiss's type); ranks that hinge on a tie closer than ~1e-7 may differ
from a float64 search.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

INDEXES = ("flat", "ivf")


class TopK(Protocol):
    """A running top-``k`` search; ``scores()`` is ``[P, k]`` float32, best first, padded
    with ``-inf`` while fewer than ``k`` gallery rows have been added."""

    def add(self, chunk: np.ndarray) -> None: ...

    def scores(self) -> np.ndarray: ...


def _rows(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


class FlatTopK:
    """Exact: each chunk searched in full, merged into the running top ``k``; ``ids()`` are
    the rows' positions in the order added (``-1`` for padding)."""

    def __init__(self, probes: np.ndarray, k: int):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.probes, self.k = _rows(probes), k
        self._best = np.full((len(self.probes), k), -np.inf, np.float32)
        self._ids = np.full((len(self.probes), k), -1, np.int64)
        self._added = 0

    def add(self, chunk: np.ndarray) -> None:
        """Search ``[n, D]`` rows (n may be 0) and keep the ``k`` best per probe (of equal
        scores, the row added first)."""
        import faiss  # lazy: the head alone does not need it

        if len(chunk) and len(self.probes):
            found, ids = faiss.knn(self.probes, _rows(chunk), min(self.k, len(chunk)),
                                   metric=faiss.METRIC_INNER_PRODUCT)
            both = np.concatenate([self._best, found], axis=1)
            order = np.argsort(-both, axis=1, kind="stable")[:, :self.k]
            self._best = np.take_along_axis(both, order, axis=1)
            self._ids = np.take_along_axis(np.concatenate([self._ids, ids + self._added], axis=1),
                                           order, axis=1)
        self._added += len(chunk)

    def scores(self) -> np.ndarray:
        return self._best.copy()

    def ids(self) -> np.ndarray:
        """``[P, k]`` int64: the position of each of :meth:`scores`' rows."""
        return self._ids.copy()


class IvfTopK:
    """Approximate: an ``IndexIVFFlat`` of ``nlist`` cells (quantiser trained on the first
    chunk, which needs at least ``nlist`` rows), ``nprobe`` cells searched per probe."""

    def __init__(self, probes: np.ndarray, k: int, nlist: int = 1024, nprobe: int = 32):
        self.probes, self.k, self.nlist, self.nprobe = _rows(probes), k, nlist, nprobe
        self._index = None

    def add(self, chunk: np.ndarray) -> None:
        import faiss

        chunk = _rows(chunk)
        if self._index is None:
            if len(chunk) < self.nlist:
                raise ValueError(f"the IVF index trains on the first chunk: it needs at least "
                                 f"nlist={self.nlist} rows, got {len(chunk)}")
            quantiser = faiss.IndexFlatIP(chunk.shape[1])
            self._index = faiss.IndexIVFFlat(quantiser, chunk.shape[1], self.nlist,
                                             faiss.METRIC_INNER_PRODUCT)
            self._index.train(chunk)
            self._index.nprobe = self.nprobe
            self._quantiser = quantiser  # faiss holds a raw pointer: keep it alive
        self._index.add(chunk)

    def scores(self) -> np.ndarray:
        if self._index is None:
            return np.full((len(self.probes), self.k), -np.inf, np.float32)
        found, ids = self._index.search(self.probes, self.k)
        return np.where(ids < 0, -np.inf, found).astype(np.float32)


def top_k_search(probes: np.ndarray, k: int, index: str = "flat") -> TopK:
    """``index``: ``flat`` (exact) or ``ivf`` (approximate, holds the gallery)."""
    if index == "flat":
        return FlatTopK(probes, k)
    if index == "ivf":
        return IvfTopK(probes, k)
    raise ValueError(f"unknown gallery index {index!r}; choose one of {', '.join(INDEXES)}")


def check_depth(top: np.ndarray, ranks) -> None:
    """ValueError unless ``top`` ``[P, K]`` holds enough scores for rank-``max(ranks)``."""
    if top.shape[1] < max(ranks):
        raise ValueError(f"rank-{max(ranks)} needs the {max(ranks)} best gallery scores, "
                         f"got {top.shape[1]}")


def rank_of(score: np.ndarray, top: np.ndarray) -> np.ndarray:
    """1 + how many of each row's ``top`` scores beat ``score`` (ties in the probe's favour).

    ``score`` ``[...]`` and ``top`` ``[..., k]``: exact for ranks up to ``k``; past ``k``
    it says ``k + 1``, which is all rank-``<= k`` figures need."""
    return 1 + (top > np.asarray(score)[..., None]).sum(axis=-1)
