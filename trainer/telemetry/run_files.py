"""The run folder's line files: ``metrics.jsonl`` and ``histograms.jsonl``.

Both hold one JSON object per line, each with an integer ``"step"`` (optimisation steps
done). The trainer appends and flushes line by line, so a run that is still going, or was
killed mid-write, may end in a partial line: :func:`read_jsonl` skips it. A resumed run
calls :func:`truncate_after` with the checkpoint's step, so no step appears twice.

``histograms.jsonl`` keeps the target / non-target angle distributions (AdaCos,
arXiv:1905.00292, Fig. 1) as counts per fixed 1-degree bin over [0, 180] degrees, one line
per sampled step: ``{"step": 500, "range_deg": [0, 180], "theta_target": [180 counts],
"theta_nontarget": [180 counts]}``. numpy only: the report reads these without torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_pipeline.errors import DataError
from data_pipeline.json_file import parse_json
from trainer.errors import Refused

METRICS = "metrics.jsonl"
HISTOGRAMS = "histograms.jsonl"
MERGE_COPY = "merge.txt"  # the list data.merge names, as the run trained it (the logger)
SUMMARY = "summary.json"  # the last invocation's summary (trainer.telemetry.logger)
HIST_RANGE = (0.0, 180.0)  # degrees
HIST_BINS = 180
LINE_BYTES = 1 << 20  # a row is a few hundred bytes; a longer line is not one of ours


class RunFileError(Refused, ValueError):
    """A run file that cannot be read (a malformed line that is not the last)."""


def _complete_lines(path: Path) -> list[tuple[str, dict]]:
    """``(raw line, parsed object)`` for every complete line; a partial last line is left out."""
    lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = parse_json(line, f"{path}:{i + 1}", "run file line", limit=LINE_BYTES)
        except DataError:
            if i == len(lines) - 1:  # no newline yet: the writer is (or died) mid-line
                break
            raise RunFileError(f"{path}:{i + 1}: not a JSON object ({line[:60]!r})") from None
        if not isinstance(row.get("step"), int):
            raise RunFileError(f"{path}:{i + 1}: a row needs an integer 'step' ({line[:60]!r})")
        out.append((line, row))
    return out


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a line file, in file order; ``[]`` when it does not exist."""
    path = Path(path)
    return [row for _, row in _complete_lines(path)] if path.is_file() else []


def truncate_after(path: str | Path, step: int) -> int:
    """Drop every row with ``"step" > step`` (and a partial last line); returns how many.

    Called on rank 0 before a resumed run appends: the rows between the checkpoint and the
    interruption are written again by the resumed steps. Atomic (``os.replace``).
    """
    path = Path(path)
    if not path.is_file():
        return 0
    rows = _complete_lines(path)
    kept = [line for line, row in rows if row["step"] <= step]
    dropped = len(rows) - len(kept)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return dropped


def angle_counts(degrees: np.ndarray) -> list[int]:
    """Counts of ``degrees`` per 1-degree bin over [0, 180] (180 included in the last bin)."""
    counts, _ = np.histogram(np.asarray(degrees, dtype=np.float64), HIST_BINS, HIST_RANGE)
    return counts.tolist()


def bin_edges() -> np.ndarray:
    """The ``HIST_BINS + 1`` bin edges in degrees."""
    return np.linspace(*HIST_RANGE, HIST_BINS + 1)


def histogram_row(step: int, angles: dict[str, np.ndarray]) -> dict:
    """One ``histograms.jsonl`` line for ``{"theta_target": degrees, ...}``."""
    return {"step": step, "range_deg": list(HIST_RANGE),
            **{name: angle_counts(values) for name, values in angles.items()}}


@dataclass(frozen=True)
class Histograms:
    """A run's angle histograms: ``counts[name]`` is ``[len(steps), bins]``."""

    steps: np.ndarray
    edges: np.ndarray  # degrees, [bins + 1]
    counts: dict[str, np.ndarray]


def read_histograms(path: str | Path) -> Histograms | None:
    """``histograms.jsonl`` as arrays; ``None`` when the file is absent or empty."""
    rows = read_jsonl(path)
    if not rows:
        return None
    lo, hi = rows[0]["range_deg"]
    names = [k for k in rows[0] if k not in ("step", "range_deg")]
    counts = {name: np.array([r[name] for r in rows], dtype=np.int64) for name in names}
    bins = next(iter(counts.values())).shape[1]
    return Histograms(np.array([r["step"] for r in rows]), np.linspace(lo, hi, bins + 1), counts)
