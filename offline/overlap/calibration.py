"""The threshold calibrated for the overlap's search (open-set identification).

``launch.overlap`` asks, for each evaluation image ``y``, which training centre is nearest
(``offline.overlap.search``) and lists that identity when the cosine reaches ``tau``. An image
whose person is not in training is then listed falsely when ``max_c cos(y, mu_c) >= tau``:
the rate of that is the false-positive identification rate (FPIR) of a search over ``C``
centres, not the per-pair false-match rate, which it exceeds about ``C``-fold
(``1 - (1 - FMR)^C``).

The calibration reads the FPIR off the same search with probes whose person has no centre:
each probe is searched against the centres of every *other* identity (``C - 1``, the real
gallery's size up to one; ``search.best_other_centre``), giving ``n`` null cosines
``v_1 >= ... >= v_n``. ``tau = v_k`` with ``k = floor(FPIR * (n + 1))``: for a new probe
exchangeable with the ``n``, ``P(max >= tau) = k / (n + 1) <= FPIR`` exactly, whatever the
distribution (the rank argument of conformal prediction; Vovk et al. 2005, and Angelopoulos
& Bates, arXiv 2107.07511, Sec. 1.1), and the realised rate of one calibration is
``Beta(k, n + 1 - k)``.

That holds for independent probes. The probes are the images of ``h`` identities, and an
identity's images search alike (one face, one set of near neighbours): the exchangeable
units are the identities, as in conformal prediction for grouped data (Dunn, Wasserman &
Ramdas, arXiv 1809.07441, whose one-draw-per-group rule is exact at ``h``). So the rate is
resolved only where ``h + 1 >= 1 / FPIR`` (:func:`resolvable` refuses below, however many
images), and the printed 90 % band is the wider of the Beta's and the cluster bootstrap's
(:func:`identity_band`: the share of probes reaching ``tau`` with the identities resampled,
which widens as an identity's images agree). ``k / (n + 1)`` is then the expected rate of
the images searched, the band its spread.

The probes are the images of identities the model never trained on (the classes of the
exclusion list it was trained with, ``offline.overlap.held_out``): those are exchangeable
with an unseen person's image. Training images, asked for explicitly, are not: a model pulls
its training images away from the other identities, so their null cosines run lower than an
unseen person's and the listed rate exceeds the target (docs/data.md measures it on ORL).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from scipy.stats import beta

from trainer.errors import Refused

RESAMPLES = 1000  # the cluster bootstrap's draws of the identities (identity_band)
RESAMPLE_CELLS = 1 << 22  # identity indices drawn per block of resamples (32 MiB)


class CalibrationError(Refused):
    """The null searches cannot resolve the asked FPIR, or there are none: one line."""


@dataclass(frozen=True)
class Calibration:
    """``threshold`` read off ``searches`` null searches by the images of ``identities``
    identities (``reached`` of them reach it) for a target ``fpir``; ``band``: the realised
    rate's 5 % and 95 % quantiles; ``probes`` says whose images were searched; ``null``
    holds their best-other-centre cosines (for the histogram)."""

    threshold: float
    fpir: float
    searches: int
    identities: int
    reached: int
    band: tuple[float, float]
    probes: str
    null: np.ndarray

    @property
    def expected_fpir(self) -> float:
        """``k / (n + 1)``: the FPIR expected at the threshold (at most ``fpir``)."""
        return self.reached / (self.searches + 1)

    def describe(self) -> str:
        """One line: the threshold, its target, the searches and the realised rate's band."""
        low, high = self.band
        return (f"threshold {self.threshold:.4f}: the FPIR {self.fpir:g} (--fpir) of a search "
                f"of {self.probes}, each against the other identities' centres: reached by "
                f"{self.reached} of {self.searches} searches of {self.identities} identities "
                f"(expected FPIR {self.expected_fpir:.2g}; 90 % band {low:.2g} to {high:.2g}, "
                "the identities resampled); --threshold sets it instead")


def calibrate(null: np.ndarray, labels: np.ndarray, fpir: float, probes: str) -> Calibration:
    """``tau = v_k``, ``k = floor(fpir * (n + 1))``, of the ``n`` null cosines, ``labels``
    their probes' identities (module docstring); CalibrationError where ``k = 0`` or the
    identities are too few to resolve ``fpir``."""
    null, labels = np.asarray(null, dtype=np.float64), np.asarray(labels)
    n, identities = len(null), len(np.unique(labels))
    k = resolvable(fpir, n, identities, probes)
    ordered = np.sort(null)[::-1]
    reached = np.searchsorted(-ordered, -ordered, side="right")  # how many reach each value
    fits = np.flatnonzero(reached <= k)  # tied values count together: at most k reach tau
    if not len(fits):
        raise CalibrationError(f"--fpir {fpir:g}: the {n} null searches' highest cosine is "
                               f"reached {reached[0]} times; raise --fpir or set --threshold")
    threshold, count = float(ordered[fits[-1]]), int(reached[fits[-1]])
    exact = beta.ppf([0.05, 0.95], count, n + 1 - count)
    clustered = identity_band(null >= threshold, labels)
    band = (float(min(exact[0], clustered[0])), float(max(exact[1], clustered[1])))
    return Calibration(threshold, fpir, n, identities, count, band, probes, ordered)


def identity_band(reach: np.ndarray, labels: np.ndarray, draws: int = RESAMPLES,
                  seed: int = 0) -> tuple[float, float]:
    """The 5 % and 95 % quantiles of the share of searches that reach the threshold
    (``reach`` ``[n]`` bool) when the ``h`` identities of ``labels`` are drawn ``h`` times
    with replacement, each bringing all its searches: the cluster bootstrap (Davison &
    Hinkley 1997, Sec. 3.8), the rate's spread when an identity's images are one draw.
    Seeded: the same band on every run and rank."""
    _, group = np.unique(labels, return_inverse=True)
    hits = np.bincount(group, weights=reach.astype(np.float64))
    sizes = np.bincount(group).astype(np.float64)
    rng, rates = np.random.default_rng(seed), []
    block = max(1, RESAMPLE_CELLS // len(sizes))
    for start in range(0, draws, block):
        drawn = rng.integers(0, len(sizes), (min(block, draws - start), len(sizes)))
        rates.append(hits[drawn].sum(1) / sizes[drawn].sum(1))
    low, high = np.quantile(np.concatenate(rates), [0.05, 0.95])
    return float(low), float(high)


def resolvable(fpir: float, n: int | None, identities: int, probes: str,
               at_most: bool = False) -> int:
    """``k = floor(fpir * (n + 1))`` of ``n`` null searches by the images of ``identities``
    identities (``n`` None: one search by each identity, the centres ``launch.overlap
    --between`` searches; ``at_most``: upper bounds, checked before the searches are made).
    CalibrationError where ``n`` or, an identity's images being one draw, ``identities``
    cannot resolve ``fpir``; the one line names the cure. Both modes' one check."""
    tiny = 1e-9  # fpir = 1/(n+1) given as a decimal
    k = int(np.floor(fpir * ((identities if n is None else n) + 1) + tiny))
    if n is not None and k < 1:
        raise CalibrationError(
            f"--fpir {fpir:g}: {'at most ' * at_most}{n} null searches ({probes}) resolve "
            f"rates down to 1/{n + 1} = {1 / (n + 1):.2g} only; raise --fpir, search more "
            "images (--null-images) or set --threshold")
    if np.floor(fpir * (identities + 1) + tiny) < 1:
        null = (f"the null is {probes}, one search each" if n is None else
                f"the null searches ({probes}) are of {'at most ' * at_most}{identities} "
                "identities, and an identity's images are one draw, not independent ones")
        raise CalibrationError(
            f"--fpir {fpir:g}: {null}: they resolve rates down to 1/{identities + 1} = "
            f"{1 / (identities + 1):.2g} only; raise --fpir, hold out more identities or set "
            "--threshold")
    return k


@dataclass(frozen=True)
class NullChoice:
    """Which images of the training folder are null probes: those of ``classes`` (None:
    of every class) whose shard key hashes below ``fraction`` of its range, so one process
    and P ranks choose the same images, about ``fraction`` of them (memory: that many
    ``[D]`` rows). ``origin`` names where ``classes`` came from."""

    fraction: float
    classes: frozenset[int] | None = None
    origin: str = "--held-out"

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
                f"training ({self.origin})")


def null_choice(images: int, classes: int, wanted: int, fpir: float,
                held_out: frozenset[int] | None = None,
                origin: str = "--held-out") -> NullChoice:
    """About ``wanted`` probes of a folder of ``images`` images and ``classes`` classes: of
    the ``held_out`` classes' images (``images * |held_out| / classes`` of them, as if
    classes were of equal size) where given, else of every image. CalibrationError, before
    any pass over the shards, where even ``images`` or ``1.2 * wanted`` searches (the hash
    sample's count is within a few per cent of ``wanted``), or the identities they are of,
    could not resolve ``fpir``."""
    pool = images if held_out is None else images * len(held_out) / max(classes, 1)
    choice = NullChoice(min(1.0, wanted / max(pool, 1)), held_out, origin)
    resolvable(fpir, min(images, int(1.2 * wanted)),
               classes if held_out is None else len(held_out), choice.probes(), at_most=True)
    return choice

