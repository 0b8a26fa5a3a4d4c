"""What the report knows of a run folder (:class:`RunData`) and how every training figure
draws runs: on :class:`matplotlib.figure.Figure` (no pyplot state; PNGs through the Agg
canvas), several runs overlaid, one colour per run throughout, a figure none of the runs has
data for left out (``None``) so the report never shows an empty frame. The figures
themselves: :mod:`offline.report_figures` (the table, and the training scalars),
:mod:`offline.angle_figures`, :mod:`offline.margin_figures`, :mod:`offline.distill_figure`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure

from trainer.telemetry.run_files import Histograms


@dataclass(frozen=True)
class RunData:
    """What the report knows of one run folder."""

    label: str  # legend entry
    config: dict  # RUN/config.yaml
    train: list[dict]  # metrics.jsonl rows of training steps (they have "loss")
    evals: list[dict]  # metrics.jsonl rows of evaluations ("val/<set>/<metric>")
    hist: Histograms | None  # RUN/histograms.jsonl

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of training metric ``key``; null (non-finite) becomes NaN."""
        rows = [r for r in self.train if key in r]
        steps = np.array([r["step"] for r in rows], dtype=np.float64)
        values = np.array([np.nan if r[key] is None else r[key] for r in rows], dtype=np.float64)
        return steps, values

    @property
    def num_classes(self) -> int | None:
        return (self.config.get("data") or {}).get("num_classes")


def colour(i: int) -> str:
    return f"C{i % 10}"


def has(runs: list[RunData], key: str) -> bool:
    return any(np.isfinite(r.series(key)[1]).any() for r in runs)


def lines(ax, runs: list[RunData], key: str, unit: Callable = np.asarray, **style) -> None:
    """One line per run; ``unit`` converts the recorded values (np.degrees for angles)."""
    for i, run in enumerate(runs):
        steps, values = run.series(key)
        if np.isfinite(values).any():
            ax.plot(steps, unit(values), color=colour(i), label=run.label, **style)


def finish(fig: Figure, ax, ylabel: str, title: str) -> Figure:
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig
