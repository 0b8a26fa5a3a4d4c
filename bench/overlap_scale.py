"""Benchmark: ``launch.overlap``'s two searches at the scale of real training sets, on
synthetic embeddings.

    nice -n 10 python bench/overlap_scale.py                              # MS1MV3 x 3 .bins
    nice -n 10 python bench/overlap_scale.py --centres 2059906 --images 2000 --null 2000
    nice -n 10 python bench/overlap_scale.py --distractors 1000000        # + MegaFace's 10^6
    nice -n 10 python bench/overlap_scale.py --between 360000 --rows 16384  # MS1MV3 x Glint360K

The two searches ``offline.overlap`` makes once the centres are known, with its own functions:

- ``null``: ``--null`` probes, each against the other identities' centres
  (``offline.overlap.search.best_other_centre``, what the calibration reads ``tau`` from);
- ``search``: ``--images`` evaluation images (``--distractors`` more where given) searched for
  their nearest centre in blocks of ``offline.overlap.search.SEARCH_BLOCK``, as ``set_overlap``
  searches each rank's share (``centre_search``).

- ``between`` (``--between N``, instead of the two above): ``launch.overlap --between``'s
  search of two training sets' class centres, ``--centres`` against ``N`` others and back
  (``offline.overlap.pairs.search_block`` over blocks of ``SEARCH_BLOCK`` centres, as
  ``nearest_centres`` calls it on each rank); ``--within`` adds each set against its own;
  ``--rows R`` searches only the first ``R`` centres of each set, against all of the other's
  (each block is searched alone: the cost is linear in the rows searched).

Defaults: 93,431 centres (MS1MV3) x 40,000 images (LFW, CFP-FP and AgeDB-30 hold 38,000),
100,000 null probes (``launch.overlap --null-images``' default), 512-d. The centres are
seeded normal draws, normalised, generated chunk by chunk; half the images and probes are a
centre plus noise (a mate), half fresh draws, which changes no timing. The embedding pass
(a backbone over every training image) is not measured: it is training's evaluation cost.

Printed per search: wall seconds and CPU-seconds (all threads: on a shared machine the wall
time is the load's, the CPU time the search's), rows per CPU-second with its spread over the
blocks (min, median, max), the resident set before the search (the process, the centres,
the probes) and the peak above it during the search (``VmHWM`` reset through
``/proc/self/clear_refs``): the search's own memory. Each run is one process. Prints
figures, asserts nothing; not run by the test suite.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

import numpy as np

from offline.overlap.pairs import search_block
from offline.overlap.search import SEARCH_BLOCK, best_other_centre, centre_search

CHUNK = 65_536  # rows generated at a time


def _memory_mib() -> tuple[float, float]:
    """(resident now, peak resident since the last :func:`_reset_peak`), MiB (Linux)."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text()
                  .splitlines() if ":" in line)
    return (int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024)


def _reset_peak() -> None:
    """Start a new peak at the resident size now (``clear_refs`` 5, Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def _unit_rows(rows: int, dim: int, seed: int) -> np.ndarray:
    """``[rows, dim]`` float32 unit rows, generated in chunks (no float64 copy of the whole)."""
    out = np.empty((rows, dim), np.float32)
    for start in range(0, rows, CHUNK):
        part = np.random.default_rng([seed, start]).standard_normal(
            (min(CHUNK, rows - start), dim), dtype=np.float32)
        out[start:start + len(part)] = part / np.linalg.norm(part, axis=1, keepdims=True)
    return out


def _probes(centres: np.ndarray, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` probes, the first half a centre plus noise (cosine about 0.7), and their
    labels (a fresh draw's: a random one, as a training image's own label would be)."""
    probes = _unit_rows(rows, centres.shape[1], seed)
    labels = np.random.default_rng([seed, 1]).integers(0, len(centres), rows)
    half = rows // 2
    for start in range(0, half, CHUNK):
        stop = min(start + CHUNK, half)
        mixed = centres[labels[start:stop]] + probes[start:stop]
        probes[start:stop] = mixed / np.linalg.norm(mixed, axis=1, keepdims=True)
    return probes, labels


def _blocks(name: str, rows: int, search) -> None:
    """Run ``search(start, stop)`` over blocks of SEARCH_BLOCK rows; print one line (none
    for no rows)."""
    if not rows:
        return
    _reset_peak()
    before, rates = _memory_mib()[0], []
    began, cpu_began = time.perf_counter(), time.process_time()
    for start in range(0, rows, SEARCH_BLOCK):
        stop = min(start + SEARCH_BLOCK, rows)
        t = time.process_time()
        search(start, stop)
        rates.append((stop - start) / (time.process_time() - t))
    took, cpu = time.perf_counter() - began, time.process_time() - cpu_began
    low, mid, high = np.percentile(rates, [0, 50, 100])
    print(f"{name:7s} {rows:>9,} rows  {took:8.1f} s ({cpu:.1f} CPU-s)  {rows / cpu:8.1f} rows "
          f"per CPU-s (blocks: {low:.1f} / {mid:.1f} / {high:.1f})  resident {before:,.0f} "
          f"MiB, peak +{_memory_mib()[1] - before:,.0f} MiB")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--centres", type=int, default=93_431)
    p.add_argument("--images", type=int, default=40_000)
    p.add_argument("--distractors", type=int, default=0,
                   help="MegaFace-like distractor images searched after --images")
    p.add_argument("--null", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--between", type=int, default=0, metavar="N",
                   help="time launch.overlap --between's search of --centres against N "
                   "other centres (and back) instead")
    p.add_argument("--within", action="store_true", help="--between: also each set against "
                   "its own other centres")
    p.add_argument("--rows", type=int, default=0, metavar="R",
                   help="--between: search only the first R centres of each set (against all "
                   "of the other's; the cost is linear in R); 0 = all")
    args = p.parse_args(argv)
    began = time.perf_counter()
    centres = _unit_rows(args.centres, args.dim, args.seed)
    if args.between:
        _between(centres, _unit_rows(args.between, args.dim, args.seed + 3), args.within,
                 args.rows, began)
        return
    null, null_labels = _probes(centres, args.null, args.seed + 1)
    images, _ = _probes(centres, args.images + args.distractors, args.seed + 2)
    print(f"{args.centres:,} centres x {args.dim}-d ({centres.nbytes / 2 ** 20:,.0f} MiB), "
          f"{args.null:,} null probes, {args.images:,} images + {args.distractors:,} "
          f"distractors; made in {time.perf_counter() - began:.1f} s, peak "
          f"{_memory_mib()[1]:,.0f} MiB")
    best = np.empty(args.null, np.float32)

    def null_block(start: int, stop: int) -> None:
        best[start:stop] = best_other_centre(null[start:stop], null_labels[start:stop],
                                             centres)

    _blocks("null", args.null, null_block)
    _blocks("search", len(images), lambda start, stop: centre_search(images[start:stop],
                                                                     centres))
    if args.null:
        print(f"null's 0.999 quantile {np.quantile(best, 0.999):.4f}")


def _between(first: np.ndarray, second: np.ndarray, within: bool, rows: int,
             began: float) -> None:
    """Each set's centres (its first ``rows``; 0: all) searched against the other's (and,
    ``within``, their own), in the tool's blocks; one line per direction."""
    galleries = [(np.arange(len(c)), c) for c in (first, second)]
    print(f"{len(first):,} x {len(second):,} centres x {first.shape[1]}-d ("
          f"{(first.nbytes + second.nbytes) / 2 ** 20:,.0f} MiB), made in "
          f"{time.perf_counter() - began:.1f} s")
    for own, name in ((0, "A->B"), (1, "B->A")):
        searched = min(rows or len(galleries[own][1]), len(galleries[own][1]))
        _blocks(name + (" +own" if within else ""), searched,
                partial(_search_from, own, galleries, within))


def _search_from(own: int, galleries: list, within: bool, start: int, stop: int) -> None:
    """Set ``own``'s centres ``start:stop`` searched as ``nearest_centres`` searches them."""
    search_block(galleries[own][1][start:stop], np.arange(start, stop), own, galleries, within)


if __name__ == "__main__":
    main()
