"""``launch.plan --world-sizes``: the GPU counts a train.global_batch recipe runs on exactly,
each with its passes, memory and modelled step (offline.plan.accumulated_step)."""

from __future__ import annotations

import json

import pytest

from launch import plan as plan_cli
from offline.plan import StepTime, accumulated_step

RECIPE = ["--config", "configs/ms1mv3_r50.yaml", "--global-batch", "1536", "--world-sizes"]


def _rows(capsys, *argv: str) -> list[dict]:
    assert plan_cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_divisor_of_the_micro_batches_with_its_passes(capsys):
    rows = _rows(capsys, *RECIPE)  # 12 micro-batches of the recipe's 128
    assert [(r["inputs"]["gpus"], r["passes"]) for r in rows] == \
        [(1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1)]
    peaks = [r["peak_bytes_per_gpu"] for r in rows]
    assert peaks == sorted(peaks, reverse=True)  # the head's shard shrinks, the micro-batch stays
    steps = [r["step"] for r in rows]
    assert all(s["images_per_s"] * s["step_s"] == pytest.approx(1536) for s in steps)
    assert steps[0]["step_s"] > steps[-1]["step_s"]


def test_a_head_whose_statistics_move_pays_one_forward_per_micro_batch_where_it_accumulates(
        capsys):
    plain = _rows(capsys, *RECIPE)
    adacos = _rows(capsys, *RECIPE, "--config", "configs/ms1mv3_r50_adacos.yaml")
    assert [r["inputs"]["statistics_pass"] for r in (plain[0], adacos[0])] == [False, True]
    for a, b in zip(adacos, plain, strict=True):
        extra = a["step"]["step_s"] - b["step"]["step_s"]
        assert extra == pytest.approx(b["step"]["backbone_s"] / 3 if a["passes"] > 1 else 0)
    one = StepTime(backbone_s=0.3, head_s=0.01, head_comm_s=0.02, grad_sync_exposed_s=0.005,
                   step_s=0.335, images_per_s=0.0, efficiency=0.0)
    without = accumulated_step(one, 128, 2, 4, statistics_pass=False)
    with_pass = accumulated_step(one, 128, 2, 4, statistics_pass=True)
    assert without.step_s == pytest.approx(4 * 0.33 + 0.005)
    assert with_pass.step_s - without.step_s == pytest.approx(4 * 0.3 / 3)
    assert accumulated_step(one, 128, 8, 1, statistics_pass=True).step_s == pytest.approx(0.335)


def test_without_a_global_batch_it_says_which_flag_is_missing(capsys):
    assert plan_cli.main(["--config", "configs/ms1mv3_r50.yaml", "--world-sizes"]) == 2
    assert "--world-sizes: needs --global-batch or a recipe with train.global_batch" in \
        capsys.readouterr().err
    assert plan_cli.main([*RECIPE, "--batch", "100"]) == 2
    assert "--global-batch=1536: not a positive multiple of the micro-batch --batch=100" in \
        capsys.readouterr().err


def test_the_plan_of_one_gpu_count_says_whether_it_splits_the_step(capsys):
    argv = ["--config", "configs/ms1mv3_r50.yaml", "--global-batch", "1536"]
    assert plan_cli.main([*argv, "--gpus", "8"]) == 0
    assert ("train.global_batch=1536: 12 micro-batches of 128, 8 GPUs cannot split it; exact "
            "on 1, 2, 3, 4, 6, 12 GPUs (--world-sizes)") in capsys.readouterr().out
    assert plan_cli.main([*argv, "--gpus", "4"]) == 0
    assert "3 pass(es) of this batch per step on 4 GPUs" in capsys.readouterr().out
