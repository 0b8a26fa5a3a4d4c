"""trainer.telemetry.run_files: line files that tolerate a run still writing, truncation,
histograms."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainer.telemetry import run_files


def _write(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_partial_last_line_is_skipped_a_broken_middle_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}], tail='{"step": 3, "lo')
    assert [r["step"] for r in run_files.read_jsonl(path)] == [1, 2]
    assert run_files.read_jsonl(tmp_path / "absent.jsonl") == []
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(run_files.RunFileError, match=r"metrics.jsonl:2: not a JSON object"):
        run_files.read_jsonl(path)
    path.write_text('{"loss": 1.0}\n')
    with pytest.raises(run_files.RunFileError, match=r":1: a row needs an integer 'step'"):
        run_files.read_jsonl(path)


def test_truncate_after_keeps_rows_up_to_the_step_and_drops_a_partial_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": float(s)} for s in (2, 4, 4, 6, 8)]  # 4 twice: loss + eval row
    _write(path, rows, tail='{"step": 10')
    assert run_files.truncate_after(path, 4) == 2
    assert run_files.read_jsonl(path) == rows[:3]
    assert path.read_text().endswith("}\n")  # appending continues on a fresh line
    assert run_files.truncate_after(path, 100) == 0 and run_files.read_jsonl(path) == rows[:3]
    assert run_files.truncate_after(tmp_path / "absent.jsonl", 1) == 0
    assert not (tmp_path / "absent.jsonl").exists()


def test_histograms_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    target = rng.uniform(20, 70, 500)
    nontarget = np.concatenate([rng.uniform(80, 100, 300), [0.0, 0.4, 179.9, 180.0]])
    path = tmp_path / "histograms.jsonl"
    with path.open("w") as f:
        for step in (50, 100):
            row = run_files.histogram_row(step, {"theta_target": target + step / 10,
                                                 "theta_nontarget": nontarget})
            f.write(json.dumps(row) + "\n")
    hist = run_files.read_histograms(path)
    assert hist.steps.tolist() == [50, 100]
    assert hist.edges[0] == 0 and hist.edges[-1] == 180 and len(hist.edges) == 181
    assert set(hist.counts) == {"theta_target", "theta_nontarget"}
    tgt, non = hist.counts["theta_target"], hist.counts["theta_nontarget"]
    assert tgt.shape == (2, 180) and tgt.sum(axis=1).tolist() == [500, 500]
    expected, _ = np.histogram(target + 10, bins=hist.edges)
    assert tgt[1].tolist() == expected.tolist()
    assert non[0, 0] == 2 and non[0, 179] == 2  # 0 and 0.4 in the first bin, 180 in the last
    assert non[0].sum() == len(nontarget)
    assert run_files.read_histograms(tmp_path / "absent.jsonl") is None
