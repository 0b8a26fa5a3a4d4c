"""The report's figure of a distilling run (trainer ``distill.*``): its loss and the
student-teacher cosine."""

from __future__ import annotations

from collections.abc import Callable

from matplotlib.figure import Figure

from offline.report_runs import RunData, colour, finish, has
from partial_fc import metric_names as names


def distill_figure(runs: list[RunData]) -> Figure | None:
    """Distilling runs (``distill.*``): the distillation loss (top) and the student-teacher
    cosine (bottom: mean solid, median dashed, the 5th-95th percentile band shaded), one colour
    per run as everywhere. No cosine panel when no run has one (``distill.loss=similarity``
    with a teacher of another width)."""
    cos = {what: names.DISTILL_COS_PREFIX + what for what in ("mean", "p5", "p50", "p95")}
    shown = [(i, run) for i, run in enumerate(runs) if has([run], names.DISTILL_LOSS)]
    if not shown:
        return None
    aligned = [(i, run) for i, run in shown if has([run], cos["mean"])]
    fig = Figure(figsize=(7, 6.4 if aligned else 3.6))
    loss_ax = fig.add_subplot(2 if aligned else 1, 1, 1)
    for i, run in shown:
        loss_ax.plot(*run.series(names.DISTILL_LOSS), color=colour(i), label=run.label)
    if aligned:
        cos_ax = fig.add_subplot(2, 1, 2, sharex=loss_ax)
        for i, run in aligned:
            cos_ax.plot(*run.series(cos["mean"]), color=colour(i), label=f"{run.label}: mean")
            cos_ax.plot(*run.series(cos["p50"]), color=colour(i), ls="--",
                        label=f"{run.label}: median")
            steps, low = run.series(cos["p5"])
            cos_ax.fill_between(steps, low, run.series(cos["p95"])[1], color=colour(i),
                                alpha=0.2, lw=0, label=f"{run.label}: 5th-95th percentile")
        finish(fig, cos_ax, "cos(student, teacher)", "student-teacher cosine")
    return finish(fig, loss_ax, "distillation loss", "distillation loss (global batch)")


# Distillation from a teacher (trainer ``distill.*``).
DISTILL_FIGURES: dict[str, tuple[Callable[[list[RunData]], Figure | None], str]] = {
    "distill": (distill_figure,
                "Distillation: its loss (distill.loss, before distill.weight) and the cosine "
                "between each sample's student and teacher embeddings over the global batch "
                "(mean, median, 5th-95th percentile: how far the least aligned samples lag)."),
}
