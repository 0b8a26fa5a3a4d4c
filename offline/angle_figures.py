"""The report's cosine and angle figures: the mean target and non-target cosine, and AdaCos
(arXiv:1905.00292) Fig. 1 over training: the target and non-target angle distributions at each
sampled step as heatmaps, with ``theta_med`` over them.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure

from offline.report_runs import RunData, colour, finish, has
from partial_fc import metric_names as names
from trainer.telemetry.run_files import Histograms


def cos_figure(runs: list[RunData]) -> Figure | None:
    """Mean target cos (solid) and mean non-target cos (dashed)."""
    if not (has(runs, names.COS_TARGET_MEAN) or has(runs, names.COS_NONTARGET_MEAN)):
        return None
    fig = Figure(figsize=(7, 3.6))
    ax = fig.add_subplot()
    for i, run in enumerate(runs):
        for key, ls, what in ((names.COS_TARGET_MEAN, "-", "target"),
                              (names.COS_NONTARGET_MEAN, "--", "non-target")):
            steps, values = run.series(key)
            if np.isfinite(values).any():
                ax.plot(steps, values, color=colour(i), ls=ls, label=f"{run.label} {what}")
    return finish(fig, ax, "mean cos", "mean target (solid) and non-target (dashed) cos")


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
            ax.set_title(f"{run.label}: {what} angles ({samples})", color=colour(i))
    fig.tight_layout()
    return fig
