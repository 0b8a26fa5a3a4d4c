"""eval.rfw in training: RFW's groups and their spread in metrics.jsonl, equal to
launch.evaluate's numbers on the same checkpoint."""

from __future__ import annotations

import pytest
from eval_helpers import make_color_bin
from launch_helpers import train_in_process

from partial_fc.eval.fairness import RFW_GROUPS
from trainer.checkpoint.backbone import load_backbone
from trainer.evaluation import evaluate_rfw_dir
from trainer.telemetry import run_files
from trainer.telemetry.evaluation_log import nested_metrics


def test_training_logs_rfw_groups(synthetic_data, tmp_path):
    rfw = tmp_path / "rfw"
    rfw.mkdir()
    for seed, group in enumerate(RFW_GROUPS):
        make_color_bin(rfw / f"{group}_test.bin", num_pairs=10, seed=seed)
    run = tmp_path / "run"
    assert train_in_process(synthetic_data, run, "train.max_steps=2", f"eval.rfw={rfw}",
                            "eval.every=2") == 0
    (row,) = [r for r in run_files.read_jsonl(run / run_files.METRICS)
              if "val/RFW/mean" in r]
    logged = nested_metrics(row)
    expected = evaluate_rfw_dir(load_backbone(run)[0], rfw, batch_size=16, device="cpu")
    for name in ("RFW", *(f"RFW/{g}" for g in RFW_GROUPS)):
        numbers = {k: v for k, v in expected[name].items() if isinstance(v, int | float)}
        assert logged[name] == pytest.approx(numbers), name
