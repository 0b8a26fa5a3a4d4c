"""The report's figures of the margins' own statistics (partial_fc.metric_names.MARGIN_STATS):
feature norms, AdaFace's EMAs and z_hat histogram, ElasticFace's margin, CurricularFace's t,
the auxiliary loss terms and MagFace's regulariser; each left out where no run logs it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from matplotlib.figure import Figure

from offline.report_runs import RunData, colour, finish, has
from partial_fc import metric_names as names


def _keys_figure(keys: tuple[tuple[str, str], ...], ylabel: str, title: str) -> Callable:
    """A builder for several metrics ``(key, what)``: colour per run, line style per key."""

    def build(runs: list[RunData]) -> Figure | None:
        if not any(has(runs, key) for key, _ in keys):
            return None
        fig = Figure(figsize=(7, 3.6))
        ax = fig.add_subplot()
        for j, (key, what) in enumerate(keys):
            for i, run in enumerate(runs):
                steps, values = run.series(key)
                if np.isfinite(values).any():
                    ax.plot(steps, values, color=colour(i), label=f"{run.label}: {what}",
                            linestyle=("-", "--", ":", "-.")[j % 4], alpha=1 - 0.6 * j / len(keys))
        return finish(fig, ax, ylabel, title)

    return build


def zhat_figure(runs: list[RunData]) -> Figure | None:
    """AdaFace's z_hat histogram over training: one stacked-share panel per run."""
    keys = names.ADAFACE_ZHAT_BINS
    shown = [run for run in runs if has([run], keys[0])]
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
