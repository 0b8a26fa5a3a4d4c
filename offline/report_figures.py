"""The report's figures in the report's order (:data:`FIGURES`, slug -> builder and caption)
and what each left out needs (:data:`WHEN_ABSENT`); here the training scalars (loss, lr, the
scale, B_avg, theta_med, throughput, ranks, verification), beside them the figures by what
they show: angles (:mod:`offline.angle_figures`), the margins' statistics
(:mod:`offline.margin_figures`), distillation (:mod:`offline.distill_figure`), all drawn as
:mod:`offline.report_runs` draws runs.

AdaCos (arXiv:1905.00292) names what to look for: the fixed scale ``sqrt(2) ln(C - 1)``
(Sec. 4.1) drawn as a reference beside ``s``; ``theta_med`` against ``pi/4``, where the
dynamic scale stops growing (Sec. 4.2); ``B_avg`` on a log axis; the target and
non-target angle distributions over training as heatmaps (Fig. 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

from offline.angle_figures import angles_figure, cos_figure
from offline.distill_figure import DISTILL_FIGURES
from offline.margin_figures import MARGIN_FIGURES
from offline.report_runs import RunData, colour, finish, has, lines
from partial_fc import metric_names as names
from partial_fc.scale import fixed_adacos_scale


def _spread(runs: list[RunData], key: str) -> float:
    """max / min of the values of ``key`` over all runs; 1 (no log axis) when there are none
    or any is <= 0 (a loss with ArcFace's Inter-Loss term can be negative)."""
    values = np.concatenate([r.series(key)[1] for r in runs])
    values = values[np.isfinite(values)]
    if not len(values) or values.min() <= 0:
        return 1.0
    return float(values.max() / values.min())


def _line_figure(key: str, ylabel: str, title: str, log: bool | str = False,
                 reference: Callable | None = None, unit: Callable = np.asarray) -> Callable:
    """A builder for one metric, one line per run (``unit`` as in _lines); ``reference(ax,
    runs)`` adds guides.
    ``log="auto"``: a log axis when the values span more than a factor 5 (s = 64 beside
    AdaCos's s = 6.5 would flatten the latter)."""

    def build(runs: list[RunData]) -> Figure | None:
        if not has(runs, key):
            return None
        fig = Figure(figsize=(7, 3.6))
        ax = fig.add_subplot()
        lines(ax, runs, key, unit)
        if log is True:
            ax.set_yscale("log")
        elif log == "auto" and _spread(runs, key) > 5:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        if reference is not None:
            reference(ax, runs)
        return finish(fig, ax, ylabel, title)

    return build


def _adacos_fixed(ax, runs: list[RunData]) -> None:
    """AdaCos's fixed scale for each distinct class count, dashed."""
    for c in sorted({r.num_classes for r in runs if r.num_classes and r.num_classes >= 3}):
        s = fixed_adacos_scale(c)
        ax.axhline(s, color="grey", ls="--", lw=1, label=f"√2·ln(C−1) = {s:.2f} (C={c})")


def _quarter_pi(ax, runs: list[RunData]) -> None:
    ax.axhline(math.degrees(math.pi / 4), color="grey", ls="--", lw=1, label="45° (π/4)")


def throughput_figure(runs: list[RunData]) -> Figure | None:
    """Images per second (all ranks) and peak memory of rank 0."""
    if not (has(runs, "img_per_s") or has(runs, "memory_mb")):
        return None
    fig = Figure(figsize=(10, 3.6))
    for j, (key, ylabel, title) in enumerate((("img_per_s", "images / s", "throughput"),
                                              ("memory_mb", "MiB", "peak memory (rank 0)"))):
        ax = fig.add_subplot(1, 2, j + 1)
        lines(ax, runs, key)
        finish(fig, ax, ylabel, title)
        ax.set_ylim(bottom=0)  # from zero: auto-scaling made a 1% wobble look like a cliff
    return fig


def ranks_figure(runs: list[RunData]) -> Figure | None:
    """The world size each step ran on (left) and the micro-batches each rank accumulated for
    it (right): a ``train.global_batch`` run resumed on other ranks keeps its step with more
    or fewer passes."""
    if not has(runs, "world_size"):
        return None
    fig = Figure(figsize=(10, 3.6))
    for j, (key, ylabel, title) in enumerate((("world_size", "ranks", "world size"),
                                              ("accumulation", "passes",
                                               "micro-batches per rank per step"))):
        ax = fig.add_subplot(1, 2, j + 1)
        for i, run in enumerate(runs):
            steps, values = run.series(key)
            if np.isfinite(values).any():
                ax.step(steps, values, where="post", color=colour(i), label=run.label)
        finish(fig, ax, ylabel, title)
        ax.set_ylim(bottom=0)
        ax.yaxis.get_major_locator().set_params(integer=True)
    return fig


def _eval_sets(runs: list[RunData]) -> list[str]:
    # A set's name may hold slashes (RFW/African); the metric's never does.
    names = {k[len("val/"):].rpartition("/")[0] for r in runs for row in r.evals for k in row
             if k.startswith("val/") and k.endswith("/accuracy")}
    return sorted(names)


def verification_figure(runs: list[RunData]) -> Figure | None:
    """Verification accuracy per evaluation set (one panel each)."""
    sets = _eval_sets(runs)
    if not sets:
        return None
    fig = Figure(figsize=(min(5 * len(sets), 15), 3.6))
    for j, name in enumerate(sets):
        ax = fig.add_subplot(1, len(sets), j + 1)
        key = f"val/{name}/accuracy"
        for i, run in enumerate(runs):
            rows = [r for r in run.evals if key in r]
            if rows:
                ax.plot([r["step"] for r in rows], [r[key] for r in rows], "o-",
                        color=colour(i), label=run.label)
        finish(fig, ax, "accuracy", f"verification: {name}")
    return fig


# slug -> (builder, caption): the report's order.
FIGURES: dict[str, tuple[Callable[[list[RunData]], Figure | None], str]] = {
    "loss": (_line_figure("loss", "loss", "training loss (global batch)", log="auto"),
             "Loss of the global batch, as the head computes it (margin and scale included); "
             "a log axis when it spans more than a factor 5 and stays positive."),
    "lr": (_line_figure("lr", "learning rate", "learning rate"), "Learning rate (warm-up, decay)."),
    "grad_norm": (_line_figure("grad_norm", "‖∇‖", "backbone gradient norm", log="auto"),
                  "The backbone's gradient norm, before train.clip_grad_norm clips it."),
    names.SCALE: (_line_figure(names.SCALE, "s", "logit scale s", log="auto",
                               reference=_adacos_fixed),
              "Logit scale s. Dashed: AdaCos's fixed scale √2·ln(C−1) (arXiv:1905.00292 "
              "Sec. 4.1); the dynamic scale starts there and follows B_avg and θ_med (Sec. 4.2)."),
    names.B_AVG: (_line_figure(names.B_AVG, "B_avg", "B_avg (non-target logit sum)", log=True),
              "B_avg: the batch mean of Σ exp(s·cos) over non-target classes, at the current s."),
    names.THETA_MED: (_line_figure(names.THETA_MED, "θ_med (degrees)",
                                   "median target angle θ_med", reference=_quarter_pi,
                                   unit=np.degrees),
                  "Median target angle θ_med, in degrees as on the angle heatmaps (the run's "
                  "files record radians). AdaCos's dynamic scale is "
                  "s = ln(B_avg) / cos(min(π/4, θ_med)): √2·ln(B_avg) while θ_med ≥ 45°, "
                  "and smaller as θ_med falls below it (stricter supervision)."),
    names.SUBCENTER_SHARE: (
        _line_figure(names.SUBCENTER_SHARE, "share", "sub-center: dominant-center share"),
        "Sub-center ArcFace (margin.subcenters): the share of the samples seen so far that are "
        "nearest their class's dominant centre (the one most of its samples are nearest). "
        "Near 1: clean classes; the rest gather on the other centres (noise, other poses); "
        "python -m launch.clean lists them."),
    "cos": (cos_figure, "Mean cosine to the target class (solid) and to the other classes "
                        "(dashed): the gap is what the margin buys."),
    "angles": (angles_figure,
               "Distribution of target and non-target angles at each sampled step "
               "(log.hist_every; colour: share of that step's angles; grey: steps with no "
               "sample), cf. AdaCos Fig. 1. Red: θ_med."),
    "throughput": (throughput_figure,
                   "Images per second over all ranks (between metric lines) and peak memory."),
    "ranks": (ranks_figure, "The world size of each step and the micro-batches each rank "
                            "accumulated for it: with train.global_batch a run resumed on "
                            "other ranks keeps its step (more ranks, fewer passes)."),
    "verification": (verification_figure, "Verification accuracy (10-fold) per eval set."),
    **MARGIN_FIGURES,
    **DISTILL_FIGURES,
}

# What a figure left out of a report shows, and what a run needs to have it, in the user's words.
WHEN_ABSENT: dict[str, str] = {
    "loss": "the loss (no step lines logged yet)",
    "lr": "the learning rate (no step lines logged yet)",
    "grad_norm": "the gradient norm (no step lines logged yet)",
    names.SCALE: "the logit scale s (no step lines logged yet)",
    names.B_AVG: "B_avg (AdaCos runs)",
    names.THETA_MED: "the median target angle θ_med (no step lines logged yet)",
    names.SUBCENTER_SHARE: "the dominant-centre share (runs with margin.subcenters > 1)",
    "cos": "the target and non-target cosines (no step lines logged yet)",
    "angles": "the angle heatmaps (log.hist_every)",
    "throughput": "images per second and memory (no step lines logged yet)",
    "ranks": "the world size and accumulation per step (runs that log them)",
    "verification": "verification accuracy (eval.bins)",
    "norms": "feature norms (AdaFace and MagFace runs)",
    "adaface": "AdaFace's norm EMAs (margin.type=adaface)",
    "adaface_zhat": "AdaFace's z_hat histogram (margin.type=adaface)",
    "curricular": "CurricularFace's t (margin.type=curricularface)",
    "elastic": "ElasticFace's margin (the elasticface_* margin types)",
    "aux": "the auxiliary loss terms (margin.intra, margin.inter, margin.triplet)",
    "magface": "MagFace's regulariser (margin.type=magface)",
    "distill": "the distillation loss and student-teacher cosine (distill.embeddings or "
               "distill.teacher)",
}
