"""The overlap's search and the threshold calibrated for it (open-set identification).

``launch.overlap`` asks, for each evaluation image ``y``, which training centre is nearest
(:func:`centre_search`: the exact flat search of ``partial_fc.eval.gallery_search``, the
centres streamed in chunks) and lists that identity when the cosine reaches ``tau``. An image
whose person is not in training is then listed falsely when ``max_c cos(y, mu_c) >= tau``:
the rate of that is the false-positive identification rate (FPIR) of a search over ``C``
centres, not the per-pair false-match rate, which it exceeds about ``C``-fold
(``1 - (1 - FMR)^C``).

The calibration reads the FPIR off the same search with probes whose person has no centre:
each probe is searched against the centres of every *other* identity (``C - 1``, the real
gallery's size up to one; :func:`best_other_centre`), giving ``n`` null cosines
``v_1 >= ... >= v_n``. ``tau = v_k`` with ``k = floor(FPIR * (n + 1))``: for a new probe
exchangeable with the ``n``, ``P(max >= tau) = k / (n + 1) <= FPIR`` exactly, whatever the
distribution (the rank argument of conformal prediction; Vovk et al. 2005, and Angelopoulos
& Bates, arXiv 2107.07511, Sec. 1.1). The realised rate of one calibration is
``Beta(k, n + 1 - k)``, whose 5 % and 95 % quantiles are printed. With ``n + 1 < 1 / FPIR``
(``k = 0``) no sample value resolves the rate: :func:`calibrate` refuses.

The probes are the images of identities the model never trained on when the user names
them (the classes of the exclusion list the model was trained with): those are exchangeable
with an unseen person's image. Without them, the training images themselves: a model pulls
its training images away from the other identities, so their null cosines run lower than an
unseen person's and the listed rate exceeds the target (docs/data.md measures it on ORL).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from partial_fc.eval.gallery_search import FlatTopK
from trainer.errors import Refused

CENTRE_CHUNK = 65_536  # centres per faiss call: the chunk's scores are [probes, k] only
EDGES = np.linspace(-1.0, 1.0, 201)  # the histograms' bins: cosine, width 0.01


class CalibrationError(Refused):
    """The null searches cannot resolve the asked FPIR, or there are none: one line."""


@dataclass(frozen=True)
class Calibration:
    """``threshold`` read off ``searches`` null searches (``reached`` of them reach it) for a
    target ``fpir``; ``probes`` says whose images were searched; ``null`` holds their
    best-other-centre cosines (for the histogram)."""

    threshold: float
    fpir: float
    searches: int
    reached: int
    probes: str
    null: np.ndarray

    @property
    def expected_fpir(self) -> float:
        """``k / (n + 1)``: the FPIR expected at the threshold (at most ``fpir``)."""
        return self.reached / (self.searches + 1)

    def band(self) -> tuple[float, float]:
        """The 5 % and 95 % quantiles of the realised FPIR, ``Beta(k, n + 1 - k)``."""
        from scipy.stats import beta

        k, n = self.reached, self.searches
        return float(beta.ppf(0.05, k, n + 1 - k)), float(beta.ppf(0.95, k, n + 1 - k))

    def describe(self) -> str:
        """One line: the threshold, its target, the searches and the realised rate's band."""
        low, high = self.band()
        return (f"threshold {self.threshold:.4f}: the FPIR {self.fpir:g} (--fpir) of a search "
                f"of {self.probes}, each against the other identities' centres: reached by "
                f"{self.reached} of {self.searches} searches (expected FPIR "
                f"{self.expected_fpir:.2g}; 90 % of calibrations give {low:.2g} to "
                f"{high:.2g}); --threshold sets it instead")


def calibrate(null: np.ndarray, fpir: float, probes: str) -> Calibration:
    """``tau = v_k``, ``k = floor(fpir * (n + 1))``, of the ``n`` null cosines (module
    docstring); CalibrationError where ``k = 0``."""
    n = len(null)
    k = resolvable(fpir, n, probes)
    ordered = np.sort(np.asarray(null, dtype=np.float64))[::-1]
    reached = np.searchsorted(-ordered, -ordered, side="right")  # how many reach each value
    fits = np.flatnonzero(reached <= k)  # tied values count together: at most k reach tau
    if not len(fits):
        raise CalibrationError(f"--fpir {fpir:g}: the {n} null searches' highest cosine is "
                               f"reached {reached[0]} times; raise --fpir or set --threshold")
    return Calibration(float(ordered[fits[-1]]), fpir, n, int(reached[fits[-1]]), probes,
                       ordered)


def resolvable(fpir: float, n: int, probes: str, at_most: bool = False) -> int:
    """``k = floor(fpir * (n + 1))`` of ``n`` null searches (``at_most``: an upper bound on
    ``n``, checked before the searches are made); CalibrationError where it is 0."""
    k = int(np.floor(fpir * (n + 1) + 1e-9))  # 1e-9: fpir = 1/(n+1) given as a decimal
    if k < 1:
        raise CalibrationError(
            f"--fpir {fpir:g}: {'at most ' if at_most else ''}{n} null searches ({probes}) "
            f"resolve rates down to 1/{n + 1} = {1 / (n + 1):.2g} only; raise --fpir, search "
            "more images (--null-images) or set --threshold")
    return k


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


@dataclass(frozen=True)
class NullChoice:
    """Which images of the training folder are null probes: those of ``classes`` (None:
    of every class) whose shard key hashes below ``fraction`` of its range, so one process
    and P ranks choose the same images, about ``fraction`` of them (memory: that many
    ``[D]`` rows)."""

    fraction: float
    classes: frozenset[int] | None = None

    def takes(self, key: str, label: int) -> bool:
        if self.classes is not None and label not in self.classes:
            return False
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") < self.fraction * 2.0 ** 64

    def probes(self) -> str:
        """Whose images, in words (the calibration line's)."""
        share = "" if self.fraction >= 1 else f"a {self.fraction:.2g} sample of "
        if self.classes is None:
            return f"{share}the training images"
        return (f"{share}the images of the {len(self.classes)} identities held out of "
                "training (--held-out)")


def null_choice(images: int, classes: int, wanted: int, fpir: float,
                held_out: frozenset[int] | None = None) -> NullChoice:
    """About ``wanted`` probes of a folder of ``images`` images and ``classes`` classes: of
    the ``held_out`` classes' images (``images * |held_out| / classes`` of them, as if
    classes were of equal size) where given, else of every image. CalibrationError, before
    any pass over the shards, where even ``images`` or ``1.2 * wanted`` searches (the hash
    sample's count is within a few per cent of ``wanted``) could not resolve ``fpir``."""
    pool = images if held_out is None else images * len(held_out) / max(classes, 1)
    choice = NullChoice(min(1.0, wanted / max(pool, 1)), held_out)
    resolvable(fpir, min(images, int(1.2 * wanted)), choice.probes(), at_most=True)
    return choice


def histogram(cosines: np.ndarray) -> list[int]:
    """Counts of ``cosines`` in :data:`EDGES`' 200 bins (NaN, an undecodable image: left out)."""
    return np.histogram(cosines[np.isfinite(cosines)], EDGES)[0].tolist()
