"""launch.report: figures from real (short) training runs, checked as matplotlib objects."""

from __future__ import annotations

import base64
import html
import re
import shutil

import numpy as np
import pytest
from eval_helpers import make_color_bin
from launch_helpers import train_in_process
from matplotlib.collections import QuadMesh

from launch import report
from offline.report_figures import DISTILL_FIGURES, FIGURES, MARGIN_FIGURES, WHEN_ABSENT
from partial_fc import metric_names as names
from partial_fc.scale import fixed_adacos_scale

STEPS = 12
# what ArcFace/AdaCos runs draw
PLAIN = [slug for slug in FIGURES if slug not in MARGIN_FIGURES and slug not in DISTILL_FIGURES]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(synthetic_data, tmp_path_factory):
    """Two smoke runs of STEPS steps: sub-center ArcFace (K = 2) with a verification set,
    dynamic AdaCos without (W&B off: a module's fixture starts before tests/conftest.py's
    per-test setting)."""
    root = tmp_path_factory.mktemp("runs")
    pairs = root / "colours.bin"
    make_color_bin(pairs, num_pairs=20)
    common = (f"train.max_steps={STEPS}", "log.every=2", "log.hist_every=4")
    arc, ada = root / "arcface", root / "adacos"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "disabled")
        assert train_in_process(synthetic_data, arc, *common, "margin.type=arcface",
                                "margin.s=16", "margin.m=0.2", "margin.subcenters=2",
                                f"eval.bins=[{pairs}]", "eval.every=6") == 0
        assert train_in_process(synthetic_data, ada, *common, "margin.type=adacos",
                                "margin.adacos=dynamic") == 0
    return arc, ada


def _plot_axes(fig):
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


def _drawn(ax) -> bool:
    """Whether ``ax`` shows data: a line with a finite point, or a non-empty mesh."""
    lines = any(np.isfinite(np.asarray(line.get_ydata(), float)).any() for line in ax.lines)
    meshes = any(isinstance(c, QuadMesh) and c.get_array().size for c in ax.collections)
    return lines or meshes


def _check_figure(slug, fig):
    assert _plot_axes(fig), slug
    for ax in _plot_axes(fig):
        if not ax.axison:  # a run's absent panel
            continue
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title(), (slug, ax)
        assert _drawn(ax), (slug, ax.get_title())
    for cbar in (ax for ax in fig.axes if ax.get_label() == "<colorbar>"):
        assert cbar.get_ylabel(), slug


def _check_angles(fig, runs) -> None:
    """Each run's row: both panels over the same steps, one drawn column per histogram
    sample centred on its step, nothing painted between samples, the theta_med line inside
    the panels' range, the number of samples in the titles."""
    panels = _plot_axes(fig)
    for row, run in enumerate(r for r in runs if r.hist is not None):
        target, nontarget = panels[2 * row : 2 * row + 2]
        assert target.get_xlim() == nontarget.get_xlim()
        lo, hi = target.get_xlim()
        steps = run.hist.steps.astype(float)
        n = len(steps)
        for ax in (target, nontarget):
            assert f"({n} sample" in ax.get_title()
            (mesh,) = [c for c in ax.collections if isinstance(c, QuadMesh)]
            edges = mesh.get_coordinates()[0, :, 0]
            cells = mesh.get_array()
            drawn = [j for j in range(cells.shape[1]) if not np.ma.getmaskarray(cells)[:, j].all()]
            assert len(drawn) == n  # drawn columns == samples
            centres = np.array([(edges[j] + edges[j + 1]) / 2 for j in drawn])
            np.testing.assert_allclose(centres, steps)
            widths = np.array([edges[j + 1] - edges[j] for j in drawn])
            spacing = np.diff(steps).min() if n > 1 else np.inf
            assert (widths <= min(spacing, hi / 60) + 1e-9).all()  # no band over unmeasured steps
            assert lo <= edges[0] and edges[-1] <= hi
        (theta,) = [line for line in target.lines if line.get_label() == "θ_med"]
        x = np.asarray(theta.get_xdata(), float)
        assert lo <= x.min() and x.max() <= hi
        assert hi >= max(x.max(), steps.max())


def test_sparse_histograms_are_thin_columns_at_their_steps():
    """A 124-step run with log.hist_every=50: two samples, not two 50-step blocks."""
    from offline.report_figures import RunData
    from trainer.telemetry.run_files import Histograms

    rows = [{"step": i, "loss": 1.0, "theta_med": 1.0 - i / 200} for i in range(5, 125, 5)]
    rows.append({"step": 124, "loss": 1.0, "theta_med": 0.4})
    counts = np.zeros((2, 180), dtype=np.int64)
    counts[:, 60:70] = 1
    hist = Histograms(np.array([50, 100]), np.linspace(0, 180, 181),
                      {"theta_target": counts, "theta_nontarget": counts})
    run = RunData("short", {"log": {"hist_every": 50}}, rows, [], hist)
    fig = FIGURES["angles"][0]([run])
    _check_angles(fig, [run])
    assert _plot_axes(fig)[0].get_xlim() == (0.0, 124 + 124 / 120)  # from step 0 to the end
    assert "(2 samples, every 50 steps)" in _plot_axes(fig)[0].get_title()


def test_every_figure_from_a_run_with_evaluation(runs):
    arc, _ = runs
    (run,) = report.load_runs([arc])
    figures = report.build_figures([run])
    assert list(figures) == PLAIN  # all of them, in order
    for slug, fig in figures.items():
        _check_figure(slug, fig)
    ax = _plot_axes(figures["verification"])[0]
    assert ax.get_title() == "verification: colours"
    assert ax.lines[0].get_xdata().tolist() == [6, STEPS]
    _check_angles(figures["angles"], [run])


def test_runs_overlay_with_reference_lines(runs):
    arc, ada = runs
    loaded = report.load_runs([arc, ada])
    figures = report.build_figures(loaded)
    assert "verification" in figures  # one run has evaluations: enough
    for slug, fig in figures.items():
        _check_figure(slug, fig)
    loss = _plot_axes(figures["loss"])[0]
    assert [line.get_label() for line in loss.lines] == ["arcface", "adacos"]
    assert loss.get_legend() is not None
    assert [line.get_xdata().tolist() for line in loss.lines] == [list(range(2, STEPS + 1, 2))] * 2
    scale = _plot_axes(figures["scale"])[0]
    reference = [line for line in scale.lines if line.get_label().startswith("√2·ln(C−1)")]
    assert len(reference) == 1  # both runs have C = 20
    assert reference[0].get_ydata()[0] == pytest.approx(fixed_adacos_scale(20))
    adacos_s = scale.lines[1].get_ydata()
    assert adacos_s[0] != pytest.approx(adacos_s[-1])  # the dynamic scale moved
    theta = _plot_axes(figures["theta_med"])[0]  # degrees, as on the angle heatmaps
    assert any(line.get_ydata()[0] == pytest.approx(45.0) for line in theta.lines)
    recorded = loaded[0].series("theta_med")[1]
    np.testing.assert_allclose(theta.lines[0].get_ydata(), np.degrees(recorded))
    assert theta.get_ylabel() == "θ_med (degrees)"
    assert len(_plot_axes(figures["angles"])) == 4  # 2 runs x (target, non-target)
    _check_angles(figures["angles"], loaded)


def test_html_is_self_contained_and_pngs_are_written(runs, tmp_path, capsys):
    arc, ada = runs
    out, pngs = tmp_path / "r" / "report.html", tmp_path / "png"
    assert report.main([str(arc), str(ada), "--out", str(out), "--png", str(pngs)]) == 0
    page = out.read_text()
    images = re.findall(r'<figure id="(\w+)"><img alt="\w+" src="data:image/png;base64,([^"]+)"',
                        page)
    assert [slug for slug, _ in images] == PLAIN
    assert all(base64.b64decode(data).startswith(PNG) for _, data in images)
    assert "src=\"http" not in page and "<script" not in page
    assert sorted(p.stem for p in pngs.iterdir()) == sorted(PLAIN)
    assert f"{len(PLAIN)} figures of 2 run(s)" in capsys.readouterr().err
    # what was left out, in the user's words with what would record it, never a slug
    note = html.unescape(re.search(r"<p class=note>(.*?)</p>", page).group(1))
    absent = [slug for slug in FIGURES if slug not in PLAIN]
    assert absent and all(WHEN_ABSENT[slug] in note for slug in absent)
    assert not any(re.search(rf"\b{slug}\b", note) for slug in absent if "_" in slug)
    assert "AdaFace's z_hat histogram (margin.type=adaface)" in note


def test_every_figure_says_what_records_it():
    assert set(WHEN_ABSENT) == set(FIGURES)


def test_run_still_going_and_folders_that_are_not_runs(runs, tmp_path, capsys):
    _, ada = runs
    going = tmp_path / "going"
    shutil.copytree(ada, going, ignore=shutil.ignore_patterns("checkpoints"))
    with (going / "metrics.jsonl").open("a") as f:
        f.write('{"step": 13, "loss": 1.')  # the trainer is mid-line
    with (going / "histograms.jsonl").open("a") as f:
        f.write('{"step": 16, "range_deg": [0, 1')
    (run,) = report.load_runs([going])
    assert run.train[-1]["step"] == STEPS and run.hist.steps[-1] == STEPS
    assert "verification" not in report.build_figures([run])  # no evaluations: left out

    empty = tmp_path / "empty"
    empty.mkdir()
    assert report.main([str(ada), str(empty)]) == 2
    err = capsys.readouterr().err
    assert err == (f"report: {empty}: not a run folder (no config.yaml or metrics.jsonl; give "
                   f"the `output` folder of launch.train, e.g. runs/<name>)\n")
    assert report.main([str(tmp_path / "absent")]) == 2
    assert capsys.readouterr().err == f"report: {tmp_path / 'absent'}: no such folder\n"
    (going / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    assert report.main([str(going)]) == 2
    assert "metrics.jsonl:2: not a JSON object" in capsys.readouterr().err


def test_scale_axis_turns_logarithmic_when_scales_differ_tenfold():
    from offline.report_figures import RunData

    def run(label, s):
        rows = [{"step": i, "loss": 1.0, "scale": s} for i in (1, 2)]
        return RunData(label, {"data": {"num_classes": 100}}, rows, [], None)

    build = FIGURES["scale"][0]
    assert build([run("a", 64.0), run("b", 6.5)]).axes[0].get_yscale() == "log"
    assert build([run("a", 30.0), run("b", 16.0)]).axes[0].get_yscale() == "linear"


def test_memory_and_throughput_axes_start_at_zero():
    from offline.report_figures import RunData

    rows = [{"step": i, "loss": 1.0, "img_per_s": 150.0 + i, "memory_mb": 941.0 + i % 2 * 9}
            for i in range(1, 9)]  # a 1% memory wobble
    fig = FIGURES["throughput"][0]([RunData("r", {}, rows, [], None)])
    low, high = zip(*(ax.get_ylim() for ax in _plot_axes(fig)), strict=True)
    assert low == (0.0, 0.0) and high[1] >= 950


def test_loss_axis_is_logarithmic_unless_a_loss_is_not_positive():
    from offline.report_figures import RunData

    def run(*losses):
        rows = [{"step": i, "loss": v} for i, v in enumerate(losses, 1)]
        return RunData("r", {}, rows, [], None)

    build = FIGURES["loss"][0]
    assert build([run(10.4, 2.0, 0.05)]).axes[0].get_yscale() == "log"  # make train's 10 -> 0.05
    assert build([run(10.4, 2.0, -0.3)]).axes[0].get_yscale() == "linear"  # an Inter-Loss term
    assert build([run(1.0, 0.8)]).axes[0].get_yscale() == "linear"


def test_margin_figures_draw_the_margins_statistics():
    """Each margin figure draws from its metrics.jsonl keys; the z_hat histogram stacks the
    eight bin shares per run."""
    from matplotlib.collections import PolyCollection

    from offline.report_figures import RunData

    rows = [{"step": i, "loss": 1.0, **{k: 0.1 * i for k in names.MARGIN_STATS},
             **{k: 1 / 8 for k in names.ADAFACE_ZHAT_BINS}} for i in (1, 2, 3)]
    runs = [RunData("a", {}, rows, [], None), RunData("b", {}, rows, [], None)]
    figures = report.build_figures(runs)
    assert [slug for slug in figures if slug in MARGIN_FIGURES] == list(MARGIN_FIGURES)
    for slug in MARGIN_FIGURES:
        if slug != "adaface_zhat":
            _check_figure(slug, figures[slug])
    # MagFace's g (about 3) on an axis of its own, not beside the ~0.03 auxiliary terms
    labels = {slug: [line.get_label() for line in figures[slug].axes[0].lines]
              for slug in ("aux", "magface", "elastic")}
    assert labels == {"aux": [f"{r}: {w}" for w in ("Intra", "Inter", "Triplet") for r in "ab"],
                      "magface": ["a: λ_g·g(a)", "b: λ_g·g(a)"],
                      "elastic": ["a: batch mean", "b: batch mean"]}
    panels = figures["adaface_zhat"].axes
    assert len(panels) == 2 and all(ax.get_title().endswith("z_hat histogram") for ax in panels)
    assert all(len([c for c in ax.collections if isinstance(c, PolyCollection)]) == 8
               for ax in panels)


def test_distillation_figure_draws_the_loss_and_the_cosine_band():
    """A distilling run with the cosine (cosine loss), one without (similarity with a teacher
    of another width) and one not distilling: both distilling runs' losses in their run's
    colour; the cosine's mean, median and 5th-95th band for the first only."""
    from matplotlib.collections import PolyCollection

    from offline.report_figures import RunData

    cos = {f"{names.DISTILL_COS_PREFIX}{k}": v for k, v in
           (("mean", 0.5), ("p5", 0.2), ("p50", 0.55), ("p95", 0.8))}
    rows = [{"step": i, "loss": 1.0, names.DISTILL_LOSS: 1 / i, **cos} for i in (1, 2, 3)]
    runs = [RunData("plain", {}, [{"step": 1, "loss": 1.0}], [], None),
            RunData("cosine", {}, rows, [], None),
            RunData("similarity", {}, [{k: r[k] for k in ("step", "loss", names.DISTILL_LOSS)}
                                       for r in rows], [], None)]
    fig = report.build_figures(runs)["distill"]
    _check_figure("distill", fig)
    loss_ax, cos_ax = _plot_axes(fig)
    assert [(line.get_label(), line.get_color()) for line in loss_ax.lines] == [
        ("cosine", "C1"), ("similarity", "C2")]
    assert loss_ax.lines[0].get_ydata().tolist() == [1, 1 / 2, 1 / 3]
    assert [line.get_label() for line in cos_ax.lines] == ["cosine: mean", "cosine: median"]
    (band,) = [c for c in cos_ax.collections if isinstance(c, PolyCollection)]
    assert band.get_paths()[0].vertices[:, 1].min() == pytest.approx(0.2)
    assert band.get_paths()[0].vertices[:, 1].max() == pytest.approx(0.8)
    assert len(_plot_axes(FIGURES["distill"][0](runs[2:]))) == 1  # no cosine: the loss alone
    assert "distill" not in report.build_figures(runs[:1])
