"""Short end-to-end training runs on a GPU (``make test-gpu``; skipped without CUDA).

Each runs ``launch.train`` on the smoke config (iresnet_tiny, a small synthetic set) with
``device=cuda`` in a fresh process, as a user would, and checks that it trained: a finite,
falling loss and a checkpoint. One GPU covers all of them; what needs several GPUs (NCCL
between ranks, one rank per GPU) is listed in docs/gpu.md.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30


def _train(data: Path, run: Path, *overrides: str, torchrun_ranks: int = 0
           ) -> subprocess.CompletedProcess:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node", str(torchrun_ranks)] if torchrun_ranks else [sys.executable])
    cmd = [*launcher, "-m", "launch.train", "--config", str(ROOT / "configs" / "smoke.yaml"),
           f"data.dir={data}", f"output={run}", "device=cuda", "log.wandb=disabled",
           "log.progress=false", "log.every=1", "data.num_workers=2", "train.batch_size=32",
           # epochs high enough that max_steps ends the run (smoke.yaml's 4 epochs of this
           # set are 20 steps, and the earlier of the two ends it)
           "train.epochs=100", f"train.max_steps={STEPS}", "checkpoint.every=10", *overrides]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _assert_trained(result: subprocess.CompletedProcess, run: Path) -> None:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    losses = _losses(run)
    assert losses and all(isinstance(x, float) and math.isfinite(x) for x in losses), losses
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    assert (run / "checkpoints" / "latest").exists()
    print([line for line in (result.stdout + result.stderr).splitlines() if "summary" in line])


@pytest.mark.parametrize("overrides", [
    ("engine.type=deepspeed", "engine.zero_stage=1", "engine.precision=bf16"),
    ("engine.type=deepspeed", "engine.zero_stage=2", "engine.precision=bf16"),
    ("engine.type=deepspeed", "engine.zero_stage=1", "engine.precision=fp16"),
    ("engine.type=ddp", "engine.precision=bf16"),
    ("engine.type=ddp", "engine.precision=bf16", "margin.type=adacos", "margin.adacos=dynamic",
     "head.sample_rate=0.1"),
], ids=["ds-zero1-bf16", "ds-zero2-bf16", "ds-zero1-fp16", "ddp-bf16", "adacos-dynamic-r0.1"])
def test_short_gpu_run_trains(synthetic_data, tmp_path, overrides):
    run = tmp_path / "run"
    _assert_trained(_train(synthetic_data, run, *overrides), run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "loss" in r][-1]
    # Steps the fp16 loss scaler dropped are counted apart from non-finite (bad) steps: some
    # while its scale falls from 2^16, never all; without a loss scaler (bf16) none.
    assert last["bad_steps"] == 0, last
    if "engine.precision=fp16" in overrides:
        assert last["skipped_steps"] < last["step"], last
    else:
        assert last["skipped_steps"] == 0, last


def test_deepspeed_run_resumes_from_its_checkpoint(synthetic_data, tmp_path):
    run = tmp_path / "run"
    ds = ("engine.type=deepspeed", "engine.zero_stage=1", "engine.precision=bf16")
    first = _train(synthetic_data, run, *ds, f"train.max_steps={STEPS // 2}")
    assert first.returncode == 0, first.stderr[-3000:]
    second = _train(synthetic_data, run, *ds)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"at step {STEPS // 2}" in second.stdout + second.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS


def test_more_ranks_than_gpus_is_refused_before_any_step(synthetic_data, tmp_path):
    ranks = torch.cuda.device_count() + 1
    result = _train(synthetic_data, tmp_path / "run", torchrun_ranks=ranks)
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines()
              if "ranks on this node" in line]
    assert errors and f"{ranks} ranks on this node" in errors[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
