"""launch.train end to end: CLI errors, torchrun on 1 node x 2 ranks vs 2 "nodes" x 1 rank.

The slow test is ``make train`` in small: configs/smoke.yaml (DeepSpeed ZeRO-1, iresnet_tiny)
on the synthetic data set via torchrun, then the same run as two torchrun processes joined
by a c10d rendezvous on loopback (--nnodes 2). Both must write the contract files and the
scale fields, lose loss, and agree step by step.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import ROOT
from spawn import free_port

from launch.train import main

STEPS = 8  # the loss falls by half within 5 steps; evaluation at 5 and at the end


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_help_and_bad_config_fail_before_any_process_group(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "key=value" in capsys.readouterr().out
    smoke = str(ROOT / "configs" / "smoke.yaml")
    assert main(["--config", smoke, "margin.tpye=cosface", f"data.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "command line: margin.tpye: unknown key" in err
    assert f"data.dir='{tmp_path}': no manifest.json there" in err
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_print_config_works_before_the_data_exists(tmp_path, capsys):
    """--print-config shows the resolved config; the missing data is a note, not a refusal."""
    import yaml

    from trainer.config import Config

    smoke = str(ROOT / "configs" / "smoke.yaml")
    assert main(["--config", smoke, "--print-config", f"data.dir={tmp_path}", "seed=3"]) == 0
    out, err = capsys.readouterr()
    cfg = Config.model_validate(yaml.safe_load(out))
    assert cfg.seed == 3 and cfg.data.dir == str(tmp_path) and cfg.data.num_classes is None
    assert f"note: data.dir='{tmp_path}': no manifest.json there" in err
    # A schema error is still refused.
    assert main(["--config", smoke, "--print-config", "seed=-1"]) == 2
    assert "seed=-1" in capsys.readouterr().err


def test_a_margin_type_override_takes_that_types_defaults_and_says_so(tmp_path, capsys):
    """``make train ARGS="margin.type=adaface"``: smoke.yaml's CosFace s gives way to
    AdaFace's default, in one warning line; a key also given on the command line stays."""
    import yaml

    from partial_fc.margins.registry import effective

    smoke = str(ROOT / "configs" / "smoke.yaml")
    assert main(["--config", smoke, "--print-config", f"data.dir={tmp_path}",
                 "margin.type=adaface"]) == 0
    out, err = capsys.readouterr()
    margin = effective({k: v for k, v in yaml.safe_load(out)["margin"].items() if k != "p_w"})
    assert (margin["type"], margin["s"], margin["m"]) == ("adaface", 64.0, 0.4)
    (line,) = [ln for ln in (out + err).splitlines() if "margin.type=adaface" in ln]
    assert "margin.s 30.0 -> 64.0, adaface's defaults" in line and "smoke.yaml" in line
    assert main(["--config", smoke, "--print-config", f"data.dir={tmp_path}",
                 "margin.type=adaface", "margin.s=30.0"]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["margin"]["s"] == 30.0
    assert yaml.safe_load(out)["margin"]["m"] == 0.4 and "replaces" not in out + err
    assert main(["--config", smoke, "--print-config", f"data.dir={tmp_path}",
                 "margin.type=cosface"]) == 0  # the recipe's own type: nothing changes
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["margin"]["m"] == 0.35 and "replaces" not in out + err


def _write_pairs(path: Path, pairs: int = 10) -> None:
    """A tiny verification set of noise images (the numbers are not the point: the call is)."""
    import io

    import numpy as np
    from PIL import Image

    from data_pipeline.verification_bin import write_bin

    rng = np.random.default_rng(0)
    images = []
    for _ in range(2 * pairs):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)).save(buf, "JPEG")
        images.append(buf.getvalue())
    write_bin(path, images, [i % 2 == 0 for i in range(pairs)])


def _torchrun(dist_args: list[str], data: Path, run: Path, extra=()) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *dist_args,
        "-m",
        "launch.train",
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        f"data.dir={data}",
        f"output={run}",
        f"train.max_steps={STEPS}",
        "log.every=1",
        "log.progress=false",
        "data.num_workers=1",
        *extra,
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(*procs: subprocess.Popen) -> str:
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outputs[0]


@pytest.mark.slow
@pytest.mark.long
def test_torchrun_one_node_and_two_node_loopback(tmp_path):
    from data_pipeline import write_synthetic_dataset

    data = tmp_path / "data"
    write_synthetic_dataset(data, num_classes=50, images_per_class=16, seed=0)
    bin_path = tmp_path / "pairs.bin"
    _write_pairs(bin_path)
    one = tmp_path / "one_node"
    evals = [f"eval.bins=[{bin_path}]", "eval.every=5"]
    out = _finish(_torchrun(["--standalone", "--nproc_per_node", "2"], data, one, evals))
    assert "summary: " in out

    records = _metrics(one)
    validation = [r for r in records if "val/pairs/accuracy" in r]
    assert [r["step"] for r in validation] == [5, STEPS]  # every 5 steps and at the end
    records = [r for r in records if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:  # the smoke recipe: CosFace s=30 on 50 classes, batch 2 x 32
        assert r["scale"] == 30.0 and r["lr"] > 0, r
        assert 0 <= r["theta_med"] <= math.pi and r["b_avg"] > 0, r
        assert -1 <= r["cos_nontarget_mean"] < r["cos_target_mean"] + 1 <= 2, r
        assert r["img_per_s"] > 0 and r["memory_mb"] > 0, r
        assert r["skipped_samples"] == 0 and r["padded_samples"] == 0, r
        # B_avg is sum over the 49 non-targets of exp(s cos): bounded by the cosines' range
        assert r["b_avg"] <= 49 * math.exp(30.0), r
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-3:]) / 3
    assert last < 0.8 * first, [r["loss"] for r in records]
    assert records[-1]["cos_target_mean"] > records[0]["cos_target_mean"]
    tag = (one / "checkpoints" / "latest").read_text().strip()
    assert (one / "checkpoints" / tag / "backbone.pt").is_file()
    assert "backbone:" in (one / "config.yaml").read_text()

    two = tmp_path / "two_nodes"
    port = free_port()
    rdzv = [
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{port}",
        "--rdzv_id",
        "loopback",
    ]
    _finish(*[_torchrun(rdzv, data, two) for _ in range(2)])
    other = _metrics(two)
    assert [r["loss"] for r in other] == pytest.approx([r["loss"] for r in records], rel=1e-4)


def _make_dry_run(*args: str) -> str:
    out = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return " ".join(out.stdout.replace("\\\n", " ").split())


def test_make_recipes_pass_their_variables_to_torchrun(tmp_path):
    import re

    makefile = (ROOT / "Makefile").read_text()
    recipes = re.search(r"^RECIPES := (.*)$", makefile, re.M).group(1).split()
    assert {r.replace("-", "_") + ".yaml" for r in recipes} == {
        p.name for p in (ROOT / "configs").glob("*.yaml")
    } - {"base.yaml", "smoke.yaml", "orl.yaml", "scale_demo.yaml"}  # scale_demo: make demo-scale
    for recipe in recipes:
        cmd = _make_dry_run(recipe, "DATA=/d", "NNODES=2", "NODE_RANK=1", "MASTER_ADDR=10.0.0.9",
                            "MASTER_PORT=1234", "NPROC_PER_NODE=8", "MAX_RESTARTS=5",
                            "ARGS=optim.lr=0.2")
        assert (
            "torchrun --nnodes 2 --node_rank 1 --master_addr 10.0.0.9 --master_port 1234 "
            "--nproc_per_node 8 --max-restarts 5 -m launch.train --config "
            f"configs/{recipe.replace('-', '_')}.yaml data.dir=/d optim.lr=0.2"
        ) in cmd, cmd
    # NNODES=MIN:MAX: elastic, a c10d rendezvous at MASTER_ADDR:MASTER_PORT, checked per count
    elastic = _make_dry_run(recipes[0], "NNODES=1:2", "MASTER_ADDR=10.0.0.9",
                            "MASTER_PORT=1234", "NPROC_PER_NODE=8")
    assert "--check --errors-only --nproc-per-node 8 --nnodes 1:2 " in elastic, elastic
    assert ("torchrun --nnodes 1:2 --rdzv-backend c10d --rdzv-endpoint 10.0.0.9:1234 "
            "--nproc_per_node 8 --max-restarts 3 -m launch.train") in elastic, elastic
    data = tmp_path / "synthetic"  # no manifest.json yet: make writes the data set first
    train = _make_dry_run("train", f"SMOKE_DATA={data}", "ARGS=train.epochs=1")
    assert "write_synthetic_dataset" in train
    assert (
        "torchrun --standalone --nproc_per_node 2 -m launch.train --config configs/smoke.yaml "
        f"data.dir={data} train.epochs=1"
    ) in train, train
    convert = _make_dry_run("convert-ms1m", "SRC=/faces_emore", "OUT=/out")
    assert "-m launch.convert insightface /faces_emore /out" in convert


@pytest.mark.slow
@pytest.mark.long
def test_smoke_recipe_trains_a_vit_on_two_ranks(tmp_path):
    """``backbone.name=vit_t`` (2 blocks: the CPU budget) on the smoke recipe (DeepSpeed), 2
    torchrun ranks: the loss falls. The full-depth run is in docs/vit.md; a ViT's steps under
    DDP and DeepSpeed, 2 ranks, checkpointing on and off: tests/trainer/test_vit_training.py."""
    from data_pipeline import write_synthetic_dataset

    data = tmp_path / "data"
    write_synthetic_dataset(data, num_classes=20, images_per_class=16, seed=0)
    run = tmp_path / "run"
    _finish(_torchrun(["--standalone", "--nproc_per_node", "2"], data, run,
                      ["backbone.name=vit_t", "backbone.depth=2", "train.batch_size=16"]))
    losses = [r["loss"] for r in _metrics(run) if "loss" in r]
    assert len(losses) == STEPS and all(map(math.isfinite, losses))
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0], losses
