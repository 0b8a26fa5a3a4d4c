"""offline.report_figures.ranks_figure: the world size and accumulation of each step, as a
run resumed on other ranks logged them (metrics.jsonl rows)."""

from __future__ import annotations

import numpy as np

from offline.report_figures import RunData, ranks_figure


def _run(shape: list[tuple[int, int]], with_keys: bool = True) -> RunData:
    rows = [{"step": s + 1, "loss": 1.0,
             **({"world_size": p, "accumulation": k} if with_keys else {})}
            for s, (p, k) in enumerate(shape)]
    return RunData("run", {}, rows, [], None)


def test_each_step_shows_the_ranks_and_passes_it_ran_with():
    fig = ranks_figure([_run([(2, 2)] * 2 + [(4, 1)] * 2 + [(1, 4)] * 2)])
    ranks, passes = (ax.lines[0] for ax in fig.axes)
    np.testing.assert_array_equal(ranks.get_xdata(), np.arange(1, 7))
    np.testing.assert_array_equal(ranks.get_ydata(), [2, 2, 4, 4, 1, 1])
    np.testing.assert_array_equal(passes.get_ydata(), [2, 2, 1, 1, 4, 4])
    assert [ax.get_title() for ax in fig.axes] == ["world size",
                                                   "micro-batches per rank per step"]


def test_runs_that_did_not_log_them_have_no_figure():
    assert ranks_figure([_run([(1, 1)] * 3, with_keys=False)]) is None
