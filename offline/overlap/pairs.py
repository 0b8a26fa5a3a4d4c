"""Identities held twice: classes of several training sets (or of one) that are one person.

``launch.overlap --between A,B [--within]``. Each class ``c`` of each set gets its centre
``mu_c`` as ``offline.overlap.centres.class_centres`` makes it (the mean unit embedding of its
images); each centre is then searched against the centres of the other sets and, with ``--within``,
against its own set's other centres (:func:`nearest_centres`: the exact flat search of
``offline.overlap.search.centre_search``). A centre whose nearest reaches the threshold
``tau`` lists that pair; a pair found from both sides is listed once (:func:`find_pairs`).

A centre whose person has no other class is listed falsely when its best cosine reaches
``tau``: the false-positive identification rate of that search, calibrated as the train/test
overlap's is (``offline.overlap.calibration.calibrate``). The null probes are the centres of
identities the model never trained on (the held-out classes of ``offline.overlap.held_out``):
each makes the very search its set's other centres make (:func:`null_cosines`), so it is
exchangeable with an unmated centre of its set, one search per identity (the grouped case of
that module's docstring is exact here). ``k / (n + 1)`` of the searches are then expected
false, and ``expected_fpir * searches`` bounds the false pairs (a pair found from both sides
counts once).

Two things that break exchangeability, and what the tool does:

- A held-out identity whose person another set also holds is a true pair in the null: it
  raises ``tau`` (fewer false pairs, fewer found). Hold out people the other sets are least
  likely to hold; the ORL test holds out ten no other set has.
- The rate is that of a search over the null's gallery (the centres its set searches). A set
  whose search covers more centres (``--between`` a small set and a large one) reaches
  ``tau`` more often, about in proportion; :func:`gallery_note` names such a set. With
  ``--within`` every search covers all centres but one, and the rate holds for all.

Work is spread over the ranks of ``process_group``: the centres as ``class_centres`` spreads
them (shards ``rank::world``, sums all-reduced), the searches by centre (``rank::world`` of
each set's classes), each centre's nearest all-reduced; one process and P ranks give the same
pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from data_pipeline.merge import Node
from offline.overlap.calibration import Calibration, CalibrationError
from offline.overlap.search import SEARCH_BLOCK, centre_search
from partial_fc.distributed import all_reduce_max, get_rank, get_world_size


@dataclass(frozen=True)
class CentreSet:
    """One data folder as the search sees it: unit ``centres`` ``[C, D]`` float32 (a class
    without a decodable image: a zero row, neither searched nor found), ``counts`` ``[C]``
    (its images), ``names`` (its identities.json; None: by label)."""

    folder: str
    centres: np.ndarray
    counts: np.ndarray
    names: tuple[str, ...] | None = None

    @property
    def searched(self) -> np.ndarray:
        """The classes with an image: those searched, and found."""
        return np.flatnonzero(self.counts > 0)

    def describe(self, c: int) -> str:
        """``name (N images)`` of class ``c`` (its label where the set has no names)."""
        name = str(c) if self.names is None else self.names[c]
        return f"{name} ({int(self.counts[c])} images)"


@dataclass(frozen=True)
class NearestCentres:
    """Each class of one set: its centre's best cosine ``scores`` ``[C]`` float64 (-inf: not
    searched) and the ``set_index`` and ``label`` ``[C]`` int64 of the centre it reached."""

    scores: np.ndarray
    set_index: np.ndarray
    label: np.ndarray


@dataclass(frozen=True)
class Pair:
    """Two classes, ``a < b`` as ``(set, class)``, whose centres meet at ``score``."""

    a: Node
    b: Node
    score: float


@dataclass(frozen=True)
class FoundPairs:
    """What a search for identities held twice found: the ``sets`` searched (``within``:
    each against its own other classes too), the ``threshold`` (read off ``calibration``;
    None: set by hand) and the ``pairs`` that reach it, highest cosine first."""

    sets: tuple[CentreSet, ...]
    within: bool
    threshold: float
    calibration: Calibration | None
    pairs: tuple[Pair, ...]

    @property
    def searches(self) -> int:
        """The classes searched: one search each."""
        return sum(len(s.searched) for s in self.sets)

    @property
    def expected_false(self) -> float | None:
        """At most how many pairs the FPIR expects falsely (a pair found from both sides
        counts once); None without a calibration."""
        if self.calibration is None:
            return None
        return self.calibration.expected_fpir * self.searches


def nearest_centres(sets: Sequence[CentreSet], within: bool,
                    process_group=None) -> list[NearestCentres]:
    """For every set, each searched class's nearest centre among the other sets' (and, with
    ``within``, its own set's other classes'). Collective over ``process_group``: rank ``r``
    searches classes ``r, r + P, ...`` of each set in blocks of ``SEARCH_BLOCK``; every rank
    returns the same lists. Memory above the centres: a block, faiss's tiles and, of a set
    with classes without an image, a copy of its searched centres."""
    rank, world = get_rank(process_group), get_world_size(process_group)
    galleries = [(s.searched, s.centres if len(s.searched) == len(s.counts)  # labels, centres
                  else np.ascontiguousarray(s.centres[s.searched])) for s in sets]
    out = []
    for i, probe_set in enumerate(sets):
        size = len(probe_set.counts)
        best = torch.full((size,), -torch.inf, dtype=torch.float64)
        where = torch.full((2, size), -1, dtype=torch.int64)
        mine = probe_set.searched[rank::world]
        for start in range(0, len(mine), SEARCH_BLOCK):
            rows = mine[start:start + SEARCH_BLOCK]
            scores, hit_set, hit_label = search_block(probe_set.centres[rows], rows, i,
                                                      galleries, within)
            best[rows] = torch.from_numpy(scores)
            where[0, rows] = torch.from_numpy(hit_set)
            where[1, rows] = torch.from_numpy(hit_label)
        best, where = all_reduce_max(best, process_group), all_reduce_max(where, process_group)
        out.append(NearestCentres(best.numpy(), where[0].numpy(), where[1].numpy()))
    return out


def search_block(probes: np.ndarray, rows: np.ndarray, own: int,
                 galleries: list[tuple[np.ndarray, np.ndarray]], within: bool
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The best centre of ``probes`` (set ``own``'s classes ``rows``) over the galleries
    searched (each set's gallery: the labels ``[G]`` of its searched classes and their
    centres ``[G, D]``): ``(scores, set, label)``; of equal cosines, the lower set, then
    label."""
    best = np.full(len(rows), -np.inf)
    hit_set = np.full(len(rows), -1, dtype=np.int64)
    hit_label = np.full(len(rows), -1, dtype=np.int64)
    for g, (labels, centres) in enumerate(galleries):
        if (g == own and not within) or len(labels) <= (g == own):
            continue
        scores, ids = centre_search(probes, centres, 2 if g == own else 1)
        scores, ids = scores.astype(np.float64), labels[ids]
        if g == own:  # its own centre is its nearest (up to ties): take the other
            other = (ids[:, 0] == rows).astype(np.int64)
            scores = np.take_along_axis(scores, other[:, None], 1)
            ids = np.take_along_axis(ids, other[:, None], 1)
        better = scores[:, 0] > best
        best[better], hit_set[better], hit_label[better] = scores[better, 0], g, ids[better, 0]
    return best, hit_set, hit_label


def null_cosines(nearest: Sequence[NearestCentres], held: dict[int, frozenset[int]],
                 sets: Sequence[CentreSet]) -> tuple[np.ndarray, np.ndarray]:
    """The held-out classes' searches (set ``i``'s ``held[i]``): their best cosines ``[h]``
    and an identity number each (``calibrate`` counts them). CalibrationError naming a held
    class that is not a class of its set, or has no image."""
    scores, ids = [], []
    for i, classes in sorted(held.items()):
        for c in sorted(classes):
            if c >= len(sets[i].counts) or sets[i].counts[c] == 0:
                raise CalibrationError(
                    f"held-out class {c} of {sets[i].folder}: "
                    + ("no image of it" if c < len(sets[i].counts) else
                       f"not a label ({len(sets[i].counts)} classes)"))
            scores.append(nearest[i].scores[c])
            ids.append(i * (1 << 40) + c)
    return np.asarray(scores, dtype=np.float64), np.asarray(ids, dtype=np.int64)


def find_pairs(nearest: Sequence[NearestCentres], threshold: float) -> list[Pair]:
    """Every searched class whose nearest centre reaches ``threshold``, as a pair with that
    centre's class; a pair found from both sides once. Highest cosine first."""
    found: dict[tuple[Node, Node], float] = {}
    for i, near in enumerate(nearest):
        for c in np.flatnonzero(near.scores >= threshold):
            a, b = sorted([(i, int(c)), (int(near.set_index[c]), int(near.label[c]))])
            found[(a, b)] = max(found.get((a, b), -np.inf), float(near.scores[c]))
    return [Pair(a, b, score) for (a, b), score in
            sorted(found.items(), key=lambda item: (-item[1], item[0]))]


def gallery_sizes(sets: Sequence[CentreSet], within: bool) -> list[int]:
    """The centres each set's classes search: the other sets' searched classes, and with
    ``within`` their own set's but one."""
    sizes = [len(s.searched) for s in sets]
    return [sum(sizes) - n + (n - 1 if within else 0) for n in sizes]


def gallery_note(sets: Sequence[CentreSet], within: bool, held: dict[int, frozenset[int]]
                 ) -> str | None:
    """A line naming the sets whose searches cover more centres than the null's smallest
    search, where more than the FPIR of them may reach the threshold; None where none does."""
    sizes = gallery_sizes(sets, within)
    null = min(sizes[i] for i in held)
    larger = [f"{sets[i].folder} ({sizes[i]:,})" for i in range(len(sets)) if sizes[i] > null]
    if not larger:
        return None
    return (f"note: the null probes searched {null:,} centres; {', '.join(larger)} search "
            "more, where more than the FPIR may reach the threshold (hold out identities of "
            "the set searching most, or use --within: docs/data.md)")
