"""bench/merge_effect.py at its smallest: a dozen synthetic people a set, two steps a training.

What it asserts is that the bench keeps working end to end (every way trained and scored, the
finder run on (f)'s model and its list reviewed against the truth, the tables and the JSON
written), not which way wins: that is the bench's own run (docs/data.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from launch_helpers import bench_module

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_smallest_setting_produces_every_row(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    bench = bench_module("merge_effect")
    out = tmp_path / "merge-effect.json"
    assert bench.main(["--settings", "synthetic", "--people", "12", "--shared", "4", "--within",
                       "1", "--test", "4", "--null", "3", "--fpir", "0.25", "--seeds", "0",
                       "--jobs", "1", "--work", str(tmp_path / "work"), "--out", str(out),
                       "train.max_steps=2", "train.batch_size=8"]) == 0
    saved = json.loads(out.read_text())
    assert [row["way"] for row in saved["rows"]] == list(bench.WAYS)
    classes = {row["way"][:3]: row["classes"] for row in saved["rows"]}
    # 12 + 1 names a set side by side; 4 shared and 2 held twice joined; A alone 13
    assert classes == {"(a)": 26, "(b)": 26, "(c)": 26, "(d)": classes["(d)"], "(e)": 20,
                       "(f)": 13}
    assert 20 <= classes["(d)"] <= 26  # the finder's true pairs joined, its false ones struck
    for row in saved["rows"]:
        assert 0 <= row["rank1"] <= 1 and row["steps"] == 2
    [finder] = saved["finders"]
    assert (finder["there_across"], finder["there_within"]) == (4, 2)
    assert finder["listed"] == finder["true_across"] + finder["true_within"] + finder["false"]
    reviewed = (tmp_path / "work" / "synthetic_reviewed-fpir0.25-seed0.txt").read_text()
    assert len(re.findall(r"^- pair ", reviewed, re.M)) == finder["false"]
    table = out.with_suffix(".md").read_text()
    assert all(f"| synthetic | {way} |" in table for way in bench.WAYS)
    assert "| synthetic | 0 | 0.25 |" in table
    assert "| synthetic | (e) merged, true list |" in capsys.readouterr().out
