"""offline.plan_engine: the engine launch.plan names for a run (the fastest measured one whose
memory fits), every GPU recipe trains with it, and its measured table is the one
docs/benchmarks.md shows."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from launch import plan as plan_cli
from offline.plan import GIB, plan
from offline.plan_engine import SPEEDS, choose_engine, measured_speeds
from offline.plan_inputs import resolve_inputs
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
GPU_RECIPES = sorted(p for p in (ROOT / "configs").glob("*.yaml")
                     if load_config(p, resolve=False).device != "cpu"
                     and load_config(p, resolve=False).data.num_classes)


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.name)
def test_every_gpu_recipe_trains_with_the_engine_the_plan_chooses(path):
    cfg = load_config(path, resolve=False)
    choice = choose_engine(resolve_inputs(str(path), {}))
    assert choice.fits
    assert (choice.engine, choice.zero_stage if choice.engine == "deepspeed" else 0) == \
        (cfg.engine.type, cfg.engine.zero_stage if cfg.engine.type == "deepspeed" else 0)
    assert "the recipe asks" not in choice.line


def _peak(inp, engine: str, zero_stage: int) -> float:
    return plan(replace(inp, engine=engine, zero_stage=zero_stage)).peak_bytes_per_gpu / GIB


def test_deepspeed_where_only_zero_fits_and_the_line_says_why():
    """ViT-L with AdamW on 8 GPUs: a GPU between DDP's peak and ZeRO-1's takes DeepSpeed
    ZeRO-1, naming both peaks; with room for DDP, DDP (measured faster); with room for
    neither, the smallest."""
    inp = resolve_inputs(None, {"classes": 1000, "gpus": 8, "backbone": "vit_l",
                                "optimizer": "adamw", "precision": "bf16", "batch": 8})
    ddp, zero1, zero2 = (_peak(inp, *c) for c in (("ddp", 0), ("deepspeed", 1),
                                                   ("deepspeed", 2)))
    assert zero2 <= zero1 < ddp
    between = replace(inp, gpu_memory=(ddp + zero1) / 2)
    choice = choose_engine(between)
    assert (choice.engine, choice.zero_stage, choice.fits) == ("deepspeed", 1, True)
    assert f"DDP needs {ddp:.1f} GiB per GPU, over {between.gpu_memory:g}" in choice.line
    assert f"DeepSpeed ZeRO-1 fits in {zero1:.1f}" in choice.line
    assert "vit_l not measured" in choice.line and "the recipe asks for DDP" in choice.line
    assert choose_engine(replace(inp, gpu_memory=ddp + 1)).engine == "ddp"
    tight = choose_engine(replace(inp, gpu_memory=zero2 / 2))
    assert not tight.fits and tight.engine == "deepspeed" and "none fits" in tight.line


def test_fp16_leaves_ddp_out():
    inp = resolve_inputs(None, {"classes": 1000, "gpus": 8, "precision": "fp16",
                                "engine": "deepspeed"})
    choice = choose_engine(inp)
    assert (choice.engine, choice.zero_stage) == ("deepspeed", 1)
    assert "fp16 needs DeepSpeed's loss scaler" in choice.line


def test_the_measured_table_is_the_one_the_benchmarks_show():
    """Each run's images/s stands in docs/benchmarks.md's "On a GPU" section, on a row of
    its engine; the decision reads the best per engine."""
    table = json.loads(SPEEDS.read_text())
    assert table["source"].startswith("docs/benchmarks.md")
    gpu = (ROOT / "docs" / "benchmarks.md").read_text().split("## On a GPU", 1)[1]
    gpu = gpu.split("\n## ", 1)[0]
    for run in table["runs"]:
        rows = [row for row in gpu.splitlines() if f"| {run['images_per_s']:,} |" in row]
        word = "DDP" if run["engine"] == "ddp" else "DeepSpeed ZeRO-1"
        assert any(row.startswith(f"| {word}") for row in rows), run
    assert measured_speeds()["iresnet50"] == {("ddp", 0): 2504, ("deepspeed", 1): 1249}


def test_launch_plan_prints_the_choice(capsys):
    assert plan_cli.main(["--config", "configs/ms1mv3_r50.yaml", "--gpus", "8"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("engine: DDP (engine.type=ddp): fits in ")
    assert plan_cli.main(["--config", "configs/ms1mv3_r50.yaml", "--json"]) == 0
    choice = json.loads(capsys.readouterr().out)["engine_choice"]
    assert (choice["engine"], choice["fits"]) == ("ddp", True)
