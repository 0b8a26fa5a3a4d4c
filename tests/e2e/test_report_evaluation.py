"""launch.evaluate's results in the run (metrics.jsonl, TensorBoard) and in launch.report's
TAR-FAR curve and RFW bars."""

from __future__ import annotations

import json

import pytest
from eval_helpers import make_run, write_rfw
from matplotlib.container import BarContainer

from launch import evaluate, report
from partial_fc.eval.fairness import RFW_GROUPS
from partial_fc.eval.ijb import IJB_FARS
from trainer.telemetry import run_files
from trainer.telemetry.evaluation_log import flat_metrics, nested_metrics

RESULTS = {
    "IJBC/1:1/norm-kept": {**{f"tar@far={f:.0e}": 0.5 + 0.08 * i
                              for i, f in enumerate(IJB_FARS)}, "image_norm": "kept"},
    **{f"RFW/{g}": {"accuracy": a, "threshold_rule": "tface"}
       for g, a in zip(RFW_GROUPS, (0.9, 0.95, 0.97, 0.93), strict=True)},
}


def test_flat_and_back():
    flat = flat_metrics(RESULTS)
    assert flat["val/RFW/African/accuracy"] == 0.9 and "val/RFW/African/threshold_rule" not in flat
    assert nested_metrics({"step": 3, **flat})["IJBC/1:1/norm-kept"]["tar@far=1e-04"] == 0.66


def test_evaluation_json_draws_tar_far_and_rfw(tmp_path):
    path = tmp_path / "r50.json"
    path.write_text(json.dumps(RESULTS))
    figures = report.build_figures([report.load_evaluation(path)])
    assert {"tar_far", "rfw"} <= set(figures)  # and the RFW groups' accuracy panels
    (line,) = figures["tar_far"].axes[0].lines
    assert list(line.get_xdata()) == list(IJB_FARS)
    assert list(line.get_ydata()) == pytest.approx([50 + 8 * i for i in range(6)])
    (bars,) = [c for c in figures["rfw"].axes[0].containers if isinstance(c, BarContainer)]
    assert [b.get_height() for b in bars] == pytest.approx([90, 95, 97, 93])
    out = tmp_path / "report.html"
    assert report.main(["--evaluation", str(path), "--out", str(out)]) == 0
    assert 'id="tar_far"' in out.read_text() and 'id="rfw"' in out.read_text()
    path.write_text("[1, 2]")
    assert report.main(["--evaluation", str(path), "--out", str(out)]) == 2


def test_log_to_run_then_report(tmp_path, capsys):
    run = make_run(tmp_path)  # its checkpoint is step-00000010
    with (run / "config.yaml").open("a") as config:
        config.write("log: {tensorboard: true}\n")
    write_rfw(tmp_path / "rfw")
    assert evaluate.main(["--checkpoint", str(run), "--rfw", str(tmp_path / "rfw"),
                          "--device", "cpu", "--log-to-run"]) == 0
    (row,) = run_files.read_jsonl(run / run_files.METRICS)
    assert row["step"] == 10 and set(nested_metrics(row)) == {
        "RFW", *(f"RFW/{g}" for g in RFW_GROUPS)}
    assert list((run / "tb").glob("events.out.tfevents.*"))
    figures = report.build_figures(report.load_runs([run]))
    assert "rfw" in figures and "tar_far" not in figures
