"""What ``launch.overlap --json/--html`` adds for a person to check the threshold: the
calibration, each set's listed and expected-false counts, and the histogram of each set's
nearest-centre cosines beside the calibration's null (the same search made by probes with no
mate). A set sharing nothing sits on the null; a set with leaks grows a second mode above
the threshold.

Histograms are counts in :data:`EDGES` (200 bins of width 0.01 over ``[-1, 1]``), named once
in the JSON as ``edges``.
"""

from __future__ import annotations

import html
import io
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from offline.overlap.calibration import Calibration
from offline.overlap.matches import SetOverlap

EDGES = np.linspace(-1.0, 1.0, 201)  # the histograms' bins: cosine, width 0.01


def histogram(cosines: np.ndarray) -> list[int]:
    """Counts of ``cosines`` in :data:`EDGES`' 200 bins (NaN, an undecodable image: left out)."""
    return np.histogram(cosines[np.isfinite(cosines)], EDGES)[0].tolist()


def calibration_json(calibration: Calibration | None) -> dict | None:
    """The calibration (None: ``--threshold`` was given): its target, the searches, the
    expected FPIR and its 90 % band, and the null's histogram."""
    if calibration is None:
        return None
    return {"fpir": calibration.fpir, "expected_fpir": calibration.expected_fpir,
            "fpir_band": list(calibration.band), "searches": calibration.searches,
            "identities": calibration.identities, "reached": calibration.reached,
            "probes": calibration.probes,
            "edges": EDGES.round(6).tolist(), "null_histogram": histogram(calibration.null)}


def set_json(result: SetOverlap, calibration: Calibration | None) -> dict:
    """One set's row: images, matched images, identities listed, at most how many of them
    the FPIR expects falsely (None without a calibration), the nearest-centre histogram."""
    return {"name": result.name, "images": result.images,
            "matched_images": result.matched_images, "shared_identities": len(result.matches),
            "expected_false": None if calibration is None
            else calibration.expected_fpir * result.images,
            "histogram": histogram(result.best)}


def histogram_figure(threshold: float, calibration: Calibration | None,
                     results: list[SetOverlap]) -> Figure:
    """Each set's nearest-centre cosines and the calibration's null, as densities (each
    histogram sums to 1), with the threshold marked."""
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    centres = (EDGES[:-1] + EDGES[1:]) / 2
    curves = [(r.name, r.best) for r in results]
    if calibration is not None:
        curves.append((f"null ({calibration.searches} searches)", calibration.null))
    for i, (name, values) in enumerate(curves):
        counts = np.asarray(histogram(np.asarray(values, dtype=np.float64)), dtype=np.float64)
        null = i == len(results)
        ax.step(centres, counts / max(counts.sum(), 1), where="mid", label=name,
                color="black" if null else f"C{i % 10}", ls="--" if null else "-")
    ax.axvline(threshold, color="grey", lw=1)
    seen = np.concatenate([np.asarray(v, dtype=np.float64) for _, v in curves] + [[threshold]])
    seen = seen[np.isfinite(seen)]
    ax.set_xlim(max(-1.0, seen.min() - 0.05), min(1.0, seen.max() + 0.05))
    ax.set_xlabel("cosine to the nearest training centre")
    ax.set_ylabel("share of images")
    ax.set_title(f"nearest-centre cosines; threshold {threshold:.3f}")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def write_page(path: Path, table: str, threshold: float, calibration: Calibration | None,
               results: list[SetOverlap]) -> None:
    """A self-contained page: the calibration line, the per-set table, the figure (SVG)."""
    svg = io.StringIO()
    histogram_figure(threshold, calibration, results).savefig(svg, format="svg")
    how = ("--threshold" if calibration is None else calibration.describe())
    path.write_text(f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>launch.overlap</title></head>
<body><h1>Train/test identity overlap</h1>
<p>{html.escape(how)}</p>
<pre>{html.escape(table)}</pre>
{svg.getvalue()[svg.getvalue().index("<svg"):]}
</body></html>
""")
