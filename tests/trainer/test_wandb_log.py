"""trainer.telemetry.wandb_log reads back a real W&B offline run (wandb's own service wrote
the file), and the sink's next segment sends the steps an earlier segment's record lacks."""

from __future__ import annotations

import json

import pytest

from trainer.telemetry import run_files, wandb_log
from trainer.telemetry.sinks import WandbSink

wandb = pytest.importorskip("wandb")


def _rows(steps):
    return [{"step": s, "loss": 10.0 - s, "lr": 0.1 * s} for s in steps]


def _segment(run_dir, steps):
    """One segment of a run in ``run_dir``: a WandbSink that logs ``steps`` and finishes;
    its service ended, as a job's ends with the job (``finish`` alone returns before the
    service has written the file)."""
    sink = WandbSink(run_dir, "offline", "test", "seg", {"a": 1})
    for row in _rows(steps):
        sink.scalars(row["step"], {k: v for k, v in row.items() if k != "step"})
    sink.close({"steps": steps[-1] if steps else 0})
    wandb.teardown()
    return sink


def test_the_reader_gives_back_a_real_offline_runs_history_and_stops_at_a_torn_end(tmp_path):
    sink = _segment(tmp_path, [1, 2, 3])
    (path,) = wandb_log.segments(tmp_path / "wandb", sink.run.id)
    log = wandb_log.read(path)
    assert log.run_ids == {sink.run.id} and not log.torn
    assert [(h["global_step"], h["loss"], h["lr"]) for h in log.history] == \
        [(r["step"], r["loss"], r["lr"]) for r in _rows([1, 2, 3])]
    data = path.read_bytes()
    torn = tmp_path / "torn.wandb"
    torn.write_bytes(data[:-3])  # a service killed mid-write
    cut = wandb_log.read(torn)
    assert cut.torn and [h["global_step"] for h in cut.history] == \
        [h["global_step"] for h in log.history][:len(cut.history)]
    (tmp_path / "other.wandb").write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match="not a W&B run file"):
        wandb_log.read(tmp_path / "other.wandb")


def test_the_next_segment_sends_the_steps_the_earlier_record_lacks_in_order(tmp_path):
    first = _segment(tmp_path, [1, 2, 3])  # its service "ended" after step 3
    (tmp_path / run_files.METRICS).write_text(
        "".join(json.dumps(r) + "\n" for r in _rows([1, 2, 3, 4, 5])))
    second = _segment(tmp_path, [])
    assert second.run.id == first.run.id and second.backfilled == 2
    paths = wandb_log.segments(tmp_path / "wandb", first.run.id)
    held = [[(h["global_step"], h["loss"]) for h in wandb_log.read(p).history] for p in paths]
    assert held == [[(s, 10.0 - s) for s in (1, 2, 3)], [(4, 6.0), (5, 5.0)]]


def test_segments_started_in_the_same_second_are_found_and_kept_in_start_order(tmp_path):
    """wandb names a segment started in the second of an earlier one ``...-<id>-1``, then
    ``-2``: the reader finds those and orders them by (time, suffix), ``-10`` after ``-2``."""
    names = ["offline-run-20261207_131954-abcd-10", "offline-run-20261207_131954-abcd-2",
             "offline-run-20261207_131955-abcd", "offline-run-20261207_131954-abcd",
             "offline-run-20261207_131954-abcd-1", "offline-run-20261207_131954-abcdef"]
    for name in names:
        folder = tmp_path / name
        folder.mkdir()
        (folder / f"run-{name.split('-')[3]}.wandb").write_bytes(b"")
    found = [p.parent.name for p in wandb_log.segments(tmp_path, "abcd")]
    assert found == ["offline-run-20261207_131954-abcd", "offline-run-20261207_131954-abcd-1",
                     "offline-run-20261207_131954-abcd-2", "offline-run-20261207_131954-abcd-10",
                     "offline-run-20261207_131955-abcd"]
