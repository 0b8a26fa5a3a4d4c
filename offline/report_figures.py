"""The report's figures, one function each, built on :class:`matplotlib.figure.Figure` (no
pyplot state; PNGs through the Agg canvas). Several runs overlay in one figure, one colour
per run throughout. A figure none of the runs has data for is left out (``None``), so the
report never shows an empty frame.

AdaCos (arXiv:1905.00292) names what to look for: the fixed scale ``sqrt(2) ln(C - 1)``
(Sec. 4.1) drawn as a reference beside ``s``; ``theta_med`` against ``pi/4``, where the
dynamic scale stops growing (Sec. 4.2); ``B_avg`` on a log axis; the target and
non-target angle distributions over training as heatmaps (Fig. 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

from partial_fc import metric_names as names
from partial_fc.scale import fixed_adacos_scale
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


def _colour(i: int) -> str:
    return f"C{i % 10}"


def _has(runs: list[RunData], key: str) -> bool:
    return any(np.isfinite(r.series(key)[1]).any() for r in runs)


def _lines(ax, runs: list[RunData], key: str, unit: Callable = np.asarray, **style) -> None:
    """One line per run; ``unit`` converts the recorded values (np.degrees for angles)."""
    for i, run in enumerate(runs):
        steps, values = run.series(key)
        if np.isfinite(values).any():
            ax.plot(steps, unit(values), color=_colour(i), label=run.label, **style)


def _finish(fig: Figure, ax, ylabel: str, title: str) -> Figure:
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


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
        if not _has(runs, key):
            return None
        fig = Figure(figsize=(7, 3.6))
        ax = fig.add_subplot()
        _lines(ax, runs, key, unit)
        if log is True:
            ax.set_yscale("log")
        elif log == "auto" and _spread(runs, key) > 5:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        if reference is not None:
            reference(ax, runs)
        return _finish(fig, ax, ylabel, title)

    return build


def _adacos_fixed(ax, runs: list[RunData]) -> None:
    """AdaCos's fixed scale for each distinct class count, dashed."""
    for c in sorted({r.num_classes for r in runs if r.num_classes and r.num_classes >= 3}):
        s = fixed_adacos_scale(c)
        ax.axhline(s, color="grey", ls="--", lw=1, label=f"√2·ln(C−1) = {s:.2f} (C={c})")


def _quarter_pi(ax, runs: list[RunData]) -> None:
    ax.axhline(math.degrees(math.pi / 4), color="grey", ls="--", lw=1, label="45° (π/4)")


def cos_figure(runs: list[RunData]) -> Figure | None:
    """Mean target cos (solid) and mean non-target cos (dashed)."""
    if not (_has(runs, names.COS_TARGET_MEAN) or _has(runs, names.COS_NONTARGET_MEAN)):
        return None
    fig = Figure(figsize=(7, 3.6))
    ax = fig.add_subplot()
    for i, run in enumerate(runs):
        for key, ls, what in ((names.COS_TARGET_MEAN, "-", "target"),
                              (names.COS_NONTARGET_MEAN, "--", "non-target")):
            steps, values = run.series(key)
            if np.isfinite(values).any():
                ax.plot(steps, values, color=_colour(i), ls=ls, label=f"{run.label} {what}")
    return _finish(fig, ax, "mean cos", "mean target (solid) and non-target (dashed) cos")


def throughput_figure(runs: list[RunData]) -> Figure | None:
    """Images per second (all ranks) and peak memory of rank 0."""
    if not (_has(runs, "img_per_s") or _has(runs, "memory_mb")):
        return None
    fig = Figure(figsize=(10, 3.6))
    for j, (key, ylabel, title) in enumerate((("img_per_s", "images / s", "throughput"),
                                              ("memory_mb", "MiB", "peak memory (rank 0)"))):
        ax = fig.add_subplot(1, 2, j + 1)
        _lines(ax, runs, key)
        _finish(fig, ax, ylabel, title)
        ax.set_ylim(bottom=0)  # from zero: auto-scaling made a 1% wobble look like a cliff
    return fig


def ranks_figure(runs: list[RunData]) -> Figure | None:
    """The world size each step ran on (left) and the micro-batches each rank accumulated for
    it (right): a ``train.global_batch`` run resumed on other ranks keeps its step with more
    or fewer passes."""
    if not _has(runs, "world_size"):
        return None
    fig = Figure(figsize=(10, 3.6))
    for j, (key, ylabel, title) in enumerate((("world_size", "ranks", "world size"),
                                              ("accumulation", "passes",
                                               "micro-batches per rank per step"))):
        ax = fig.add_subplot(1, 2, j + 1)
        for i, run in enumerate(runs):
            steps, values = run.series(key)
            if np.isfinite(values).any():
                ax.step(steps, values, where="post", color=_colour(i), label=run.label)
        _finish(fig, ax, ylabel, title)
        ax.set_ylim(bottom=0)
        ax.yaxis.get_major_locator().set_params(integer=True)
    return fig


def _sample_columns(steps: np.ndarray, x_max: float) -> tuple[np.ndarray, float]:
    """Column edges for the sampled ``steps`` (sorted): a column of width ``w`` centred on
    each step, with a gap column between two samples. ``w`` is the smallest spacing between
    samples, at most 1/60 of ``[0, x_max]``: samples taken every step touch, sparse ones stay
    thin stripes, so no colour stands for steps that were not measured. Returns
    ``(edges [2n], w)``; columns ``0, 2, 4, ...`` are the samples."""
    w = x_max / 60
    if len(steps) > 1:
        w = min(w, float(np.diff(steps).min()))
    return np.stack([steps - w / 2, steps + w / 2], axis=1).ravel(), w


def _sample_cells(share: np.ndarray) -> np.ma.MaskedArray:
    """``share [n, bins]`` as pcolormesh cells ``[bins, 2n - 1]``, the gap columns masked."""
    n, bins = share.shape
    cells = np.ma.masked_all((bins, 2 * n - 1))
    cells[:, ::2] = share.T
    return cells


def _angle_window(hist: Histograms) -> tuple[float, float]:
    """The angle range (degrees, 10-degree steps) that holds all the mass of every step."""
    total = sum(c.sum(axis=0) for c in hist.counts.values())
    nonzero = np.nonzero(total)[0]
    if not len(nonzero):
        return 0.0, 180.0
    lo, hi = hist.edges[nonzero[0]], hist.edges[nonzero[-1] + 1]
    return max(0.0, 10 * math.floor(lo / 10)), min(180.0, 10 * math.ceil(hi / 10))


def angles_figure(runs: list[RunData]) -> Figure | None:
    """Per run (rows): target and non-target angle distribution at each sampled step, AdaCos
    Fig. 1 over time. One column per histogram sample at its step (colour: share of that
    step's angles; grey where no sample was taken), both panels and the ``theta_med`` line
    (degrees, target panel) over the same steps; the titles say how many samples there are."""
    with_hist = [(i, r) for i, r in enumerate(runs) if r.hist is not None]
    if not with_hist:
        return None
    fig = Figure(figsize=(10, 3.2 * len(with_hist)))
    for row, (i, run) in enumerate(with_hist):
        hist = run.hist
        steps = hist.steps.astype(float)
        theta_steps, theta = run.series(names.THETA_MED)
        x_max = float(max(steps.max(), theta_steps.max(initial=0)))
        edges, width = _sample_columns(steps, x_max)
        n = len(steps)
        every = (run.config.get("log") or {}).get("hist_every")
        samples = f"{n} sample{'s' if n != 1 else ''}" + (f", every {every} steps" if every
                                                         else "")
        lo, hi = _angle_window(hist)
        first = None
        for col, (name, what) in enumerate((("theta_target", "target"),
                                            ("theta_nontarget", "non-target"))):
            ax = fig.add_subplot(len(with_hist), 2, 2 * row + col + 1, sharex=first)
            first = first or ax
            counts = hist.counts.get(name)
            if counts is None:
                ax.set_axis_off()
                continue
            share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
            ax.set_facecolor("0.88")
            mesh = ax.pcolormesh(edges, hist.edges, _sample_cells(share), cmap="viridis",
                                 shading="flat", vmin=0)
            fig.colorbar(mesh, ax=ax, label="share of angles")
            if name == "theta_target" and np.isfinite(theta).any():
                ax.plot(theta_steps, np.degrees(theta), color="tab:red", lw=1.2, label="θ_med")
                ax.legend(fontsize="small", loc="upper right")
            ax.set_xlim(0, x_max + width / 2)
            ax.set_ylim(lo, hi)
            ax.set_xlabel("step")
            ax.set_ylabel("angle (degrees)")
            ax.set_title(f"{run.label}: {what} angles ({samples})", color=_colour(i))
    fig.tight_layout()
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
                        color=_colour(i), label=run.label)
        _finish(fig, ax, "accuracy", f"verification: {name}")
    return fig


def _keys_figure(keys: tuple[tuple[str, str], ...], ylabel: str, title: str) -> Callable:
    """A builder for several metrics ``(key, what)``: colour per run, line style per key."""

    def build(runs: list[RunData]) -> Figure | None:
        if not any(_has(runs, key) for key, _ in keys):
            return None
        fig = Figure(figsize=(7, 3.6))
        ax = fig.add_subplot()
        for j, (key, what) in enumerate(keys):
            for i, run in enumerate(runs):
                steps, values = run.series(key)
                if np.isfinite(values).any():
                    ax.plot(steps, values, color=_colour(i), label=f"{run.label}: {what}",
                            linestyle=("-", "--", ":", "-.")[j % 4], alpha=1 - 0.6 * j / len(keys))
        return _finish(fig, ax, ylabel, title)

    return build


def zhat_figure(runs: list[RunData]) -> Figure | None:
    """AdaFace's z_hat histogram over training: one stacked-share panel per run."""
    keys = names.ADAFACE_ZHAT_BINS
    shown = [run for run in runs if _has([run], keys[0])]
    if not shown:
        return None
    fig = Figure(figsize=(7, 1.2 + 2.2 * len(shown)))
    colours = [f"C{k}" for k in range(len(keys))]
    edges = np.linspace(-1, 1, len(keys) + 1)
    bins = [f"[{a:+.2f}, {b:+.2f})" for a, b in zip(edges[:-1], edges[1:], strict=True)]
    for i, run in enumerate(shown):
        ax = fig.add_subplot(len(shown), 1, i + 1)
        steps = run.series(keys[0])[0]
        shares = np.nan_to_num(np.stack([run.series(k)[1] for k in keys]))
        ax.stackplot(steps, shares, colors=colours, labels=bins)
        ax.set_ylim(0, 1)
        ax.set_ylabel("share")
        ax.set_title(f"{run.label}: AdaFace z_hat histogram", fontsize="medium")
    ax.set_xlabel("step")
    ax.legend(fontsize="x-small", ncol=4, loc="lower left")
    fig.tight_layout()
    return fig


def distill_figure(runs: list[RunData]) -> Figure | None:
    """Distilling runs (``distill.*``): the distillation loss (top) and the student-teacher
    cosine (bottom: mean solid, median dashed, the 5th-95th percentile band shaded), one colour
    per run as everywhere. No cosine panel when no run has one (``distill.loss=similarity``
    with a teacher of another width)."""
    cos = {what: names.DISTILL_COS_PREFIX + what for what in ("mean", "p5", "p50", "p95")}
    shown = [(i, run) for i, run in enumerate(runs) if _has([run], names.DISTILL_LOSS)]
    if not shown:
        return None
    aligned = [(i, run) for i, run in shown if _has([run], cos["mean"])]
    fig = Figure(figsize=(7, 6.4 if aligned else 3.6))
    loss_ax = fig.add_subplot(2 if aligned else 1, 1, 1)
    for i, run in shown:
        loss_ax.plot(*run.series(names.DISTILL_LOSS), color=_colour(i), label=run.label)
    if aligned:
        cos_ax = fig.add_subplot(2, 1, 2, sharex=loss_ax)
        for i, run in aligned:
            cos_ax.plot(*run.series(cos["mean"]), color=_colour(i), label=f"{run.label}: mean")
            cos_ax.plot(*run.series(cos["p50"]), color=_colour(i), ls="--",
                        label=f"{run.label}: median")
            steps, low = run.series(cos["p5"])
            cos_ax.fill_between(steps, low, run.series(cos["p95"])[1], color=_colour(i),
                                alpha=0.2, lw=0, label=f"{run.label}: 5th-95th percentile")
        _finish(fig, cos_ax, "cos(student, teacher)", "student-teacher cosine")
    return _finish(fig, loss_ax, "distillation loss", "distillation loss (global batch)")


# Distillation from a teacher (trainer ``distill.*``).
DISTILL_FIGURES: dict[str, tuple[Callable[[list[RunData]], Figure | None], str]] = {
    "distill": (distill_figure,
                "Distillation: its loss (distill.loss, before distill.weight) and the cosine "
                "between each sample's student and teacher embeddings over the global batch "
                "(mean, median, 5th-95th percentile: how far the least aligned samples lag)."),
}

# The margins' own statistics (partial_fc.metric_names.MARGIN_STATS).
MARGIN_FIGURES: dict[str, tuple[Callable[[list[RunData]], Figure | None], str]] = {
    "norms": (_keys_figure(((names.NORM_MEAN, "mean"), (names.NORM_STD, "std"),
                            (names.NORM_MIN, "min"), (names.NORM_MAX, "max")),
                           "||x||", "feature norms (global batch)"),
              "Feature norms before normalisation: AdaFace's image-quality proxy "
              "(arXiv:2204.00964), MagFace's magnitude (arXiv:2103.06627, kept in [l_a, u_a])."),
    "adaface": (_keys_figure(((names.ADAFACE_EMA_MEAN, "EMA mean"),
                              (names.ADAFACE_EMA_STD, "EMA std")),
                             "||x||", "AdaFace norm EMAs (Eq. 12)"),
                "AdaFace's EMAs of the batch norm mean and std, which standardise z_hat."),
    "elastic": (_keys_figure(((names.ELASTIC_MARGIN_MEAN, "batch mean"),), "m",
                             "ElasticFace margin"),
                "ElasticFace's margin, drawn per sample from N(m, σ) (arXiv:2109.09416 Eq. 4-5): "
                "the mean over the batch."),
    "adaface_zhat": (zhat_figure,
                     "Share of the batch per z_hat bin (eight over [-1, 1]): low z_hat (low "
                     "norm, hard images) shifts the margin to the angle, high z_hat to the "
                     "additive term (arXiv:2204.00964 Eq. 13). The norm EMAs start where the "
                     "authors' code starts them (mean 20, std 100), so z_hat sits near 0, in "
                     "one or two bins, until the EMAs have followed the batches: a short run "
                     "may show nothing else."),
    "curricular": (_keys_figure(((names.CURRICULAR_T, "t"),
                                 (names.HARD_NEGATIVE_SHARE, "hard-negative share")),
                                "value", "CurricularFace t and hard negatives"),
                   "CurricularFace's t (EMA of the mean target cosine, arXiv:2004.00288 Eq. 9) "
                   "and the share of sampled non-target pairs it modulates."),
    "aux": (_keys_figure(((names.LOSS_INTRA, "Intra"), (names.LOSS_INTER, "Inter"),
                          (names.LOSS_TRIPLET, "Triplet")),
                         "weighted term", "auxiliary loss terms"),
            "ArcFace's Intra-, Inter- and Triplet-Loss (arXiv:1801.07698 Eq. 5-7), each as added "
            "to the loss."),
    "magface": (_keys_figure(((names.LOSS_MAGFACE_G, "λ_g·g(a)"),), "weighted term",
                             "MagFace regulariser"),
                "MagFace's regulariser λ_g·g(a) (arXiv:2103.06627 Eq. 4) as added to the loss, "
                "on an axis of its own: it is about 100 times the auxiliary terms."),
}

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
