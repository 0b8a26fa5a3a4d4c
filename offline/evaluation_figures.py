"""The report's figures of ``launch.evaluate``'s protocols: IJB 1:1's TAR against FAR and
RFW's accuracy by group. Each run's newest evaluation row holding them is drawn (rows that
``launch.evaluate --log-to-run`` appends to ``metrics.jsonl``, or a ``--json`` file given to
``launch.report --evaluation``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from matplotlib.figure import Figure

from offline.report_runs import RunData
from partial_fc.eval.fairness import RFW_GROUPS
from partial_fc.eval.ijb import IJB_FARS
from trainer.telemetry.evaluation_log import nested_metrics


def _newest(run: RunData, wanted: Callable[[dict[str, dict]], bool]) -> dict[str, dict]:
    """The newest evaluation row of ``run`` (nested: ``{set: {metric: value}}``) for which
    ``wanted`` holds; ``{}`` when none does."""
    for row in reversed(run.evals):
        nested = nested_metrics(row)
        if wanted(nested):
            return nested
    return {}


def _finish(fig: Figure, ax, ylabel: str, title: str, **grid) -> Figure:
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, **grid)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def _ijb_curves(results: dict[str, dict]) -> dict[str, dict]:
    return {name: r for name, r in results.items()
            if "/1:1/" in name and all(f"tar@far={far:.0e}" in r for far in IJB_FARS)}


def tar_far_figure(runs: list[RunData]) -> Figure | None:
    """TAR at each IJB FAR (1e-6 ... 1e-1, log axis), one line per run and IJB 1:1 row."""
    curves = [(run.label, _ijb_curves(_newest(run, lambda r: bool(_ijb_curves(r)))))
              for run in runs]
    if not any(c for _, c in curves):
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    for i, (label, rows) in enumerate(curves):
        for j, (name, r) in enumerate(sorted(rows.items())):
            ax.plot(IJB_FARS, [100 * r[f"tar@far={far:.0e}"] for far in IJB_FARS], marker="o",
                    color=f"C{i % 10}", ls=("-", "--", ":")[j % 3], label=f"{label}: {name}")
    ax.set_xscale("log")
    ax.set_xlabel("FAR")
    return _finish(fig, ax, "TAR (%)", "IJB 1:1: TAR against FAR", which="both")


def _rfw(results: dict[str, dict]) -> bool:
    return all("accuracy" in results.get(f"RFW/{g}", {}) for g in RFW_GROUPS)


def rfw_figure(runs: list[RunData]) -> Figure | None:
    """Accuracy per RFW group, one bar per run in each group, the runs' mean dashed."""
    rows = [(run.label, _newest(run, _rfw)) for run in runs]
    rows = [(label, r) for label, r in rows if r]
    if not rows:
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    width = 0.8 / len(rows)
    x = np.arange(len(RFW_GROUPS))
    for i, (label, r) in enumerate(rows):
        accuracy = [100 * r[f"RFW/{g}"]["accuracy"] for g in RFW_GROUPS]
        ax.bar(x + (i - (len(rows) - 1) / 2) * width, accuracy, width, color=f"C{i % 10}",
               label=label)
        ax.axhline(np.mean(accuracy), color=f"C{i % 10}", ls="--", lw=1)
    ax.set_xticks(x, RFW_GROUPS)
    low = min(100 * r[f"RFW/{g}"]["accuracy"] for _, r in rows for g in RFW_GROUPS)
    ax.set_ylim(max(0.0, low - 5), 100)  # the differences are a few points: no zero baseline
    return _finish(fig, ax, "accuracy (%)", "RFW: accuracy by group (dashed: mean)", axis="y")


# slug -> (builder, caption), drawn after the training figures; and what an absent one needs.
EVALUATION_FIGURES: dict[str, tuple[Callable[[list[RunData]], Figure | None], str]] = {
    "tar_far": (tar_far_figure, "IJB-B/C 1:1: TAR at FAR 1e-6 … 1e-1 (the closest-FAR rule), "
                                "per row (norm-kept: eval_ijbc.py's pooling; unit-norm)."),
    "rfw": (rfw_figure, "RFW: 10-fold accuracy per group (TFace's threshold rule unless the "
                        "evaluation chose exact); dashed, each run's mean over the groups."),
}
EVALUATION_WHEN_ABSENT = {
    "tar_far": "IJB's TAR–FAR curve (launch.evaluate --ijb with --log-to-run, or --evaluation)",
    "rfw": "RFW's groups (launch.evaluate --rfw with --log-to-run, or --evaluation)",
}
