"""The GPU path's refusals, checked on CPU by telling torch what a GPU machine would say.

Each is one line naming the fix, found while the config is resolved, before any process group
(torchrun's LOCAL_WORLD_SIZE / WORLD_SIZE are read from the environment as the ranks see it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.config import ConfigError, load_config

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"


@pytest.fixture
def machine(monkeypatch):
    """``machine(gpus=, bf16=, nccl=, local_ranks=, world=)``: what torch and torchrun report."""

    def pretend(gpus=1, bf16=True, nccl=True, local_ranks=1, world=1):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
        monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: nccl)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
        monkeypatch.setenv("WORLD_SIZE", str(world))

    return pretend


def _resolve(data: Path, tmp_path: Path, *overrides: str):
    return load_config(SMOKE, [f"data.dir={data}", f"output={tmp_path / 'run'}",
                               "log.wandb=disabled", *overrides])


def test_one_rank_per_gpu_passes(machine, synthetic_data, tmp_path):
    machine(gpus=2, local_ranks=2, world=2)
    gpu_bf16 = ("device=cuda", "engine.precision=bf16", "engine.zero_stage=1")
    _resolve(synthetic_data, tmp_path, *gpu_bf16)  # accepted: a refusal raises ConfigError
    machine(gpus=2, local_ranks=3, world=3)  # one rank more than GPUs: the same config refused
    with pytest.raises(ConfigError, match="3 ranks on this node but 2 GPU"):
        _resolve(synthetic_data, tmp_path, *gpu_bf16)


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_more_ranks_than_gpus_is_refused(machine, synthetic_data, tmp_path, device):
    machine(gpus=1, local_ranks=2, world=2)
    with pytest.raises(ConfigError) as err:
        _resolve(synthetic_data, tmp_path, f"device={device}")
    line = next(x for x in str(err.value).splitlines() if "ranks on this node" in x)
    assert "2 ranks on this node but 1 GPU(s)" in line and "--nproc_per_node 1" in line


def test_bf16_on_a_gpu_without_it_is_refused(machine, synthetic_data, tmp_path):
    machine(gpus=1, bf16=False)
    with pytest.raises(ConfigError, match=r"engine.precision='bf16': this GPU has no bf16"):
        _resolve(synthetic_data, tmp_path, "device=cuda", "engine.precision=bf16",
                 "engine.zero_stage=1")


def test_several_gpu_ranks_without_nccl_are_refused(machine, synthetic_data, tmp_path):
    machine(gpus=2, nccl=False, local_ranks=2, world=2)
    with pytest.raises(ConfigError, match=r"no NCCL"):
        _resolve(synthetic_data, tmp_path, "device=cuda")


def test_cpu_runs_ignore_the_gpus(machine, synthetic_data, tmp_path):
    machine(gpus=1, bf16=False, nccl=False, local_ranks=4, world=4)
    _resolve(synthetic_data, tmp_path, "device=cpu")  # accepted: a refusal raises ConfigError
    with pytest.raises(ConfigError, match="4 ranks on this node but 1 GPU"):  # on the GPU: not
        _resolve(synthetic_data, tmp_path, "device=cuda")


def test_missing_deepspeed_is_a_config_error(machine, synthetic_data, tmp_path, monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else find(name, *a))
    machine(gpus=0)
    with pytest.raises(ConfigError, match=r"partial-fc\[deepspeed\]"):
        _resolve(synthetic_data, tmp_path, "engine.type=deepspeed")
    _resolve(synthetic_data, tmp_path, "engine.type=ddp")  # DDP needs no DeepSpeed: accepted


def test_cuda_without_a_gpu_is_refused(machine, synthetic_data, tmp_path):
    machine(gpus=0)
    with pytest.raises(ConfigError, match=r"device='cuda': no CUDA device on this machine"):
        _resolve(synthetic_data, tmp_path, "device=cuda")


@pytest.mark.parametrize("gpus", [0, 1])
def test_fp16_needs_a_gpu(machine, synthetic_data, tmp_path, gpus):
    """``device=auto`` trains on the GPU when torch sees one: fp16 is accepted there only."""
    machine(gpus=gpus)
    fp16 = ("device=auto", "engine.type=deepspeed", "engine.precision=fp16")
    if gpus:
        _resolve(synthetic_data, tmp_path, *fp16)  # accepted: a refusal raises ConfigError
    else:
        with pytest.raises(ConfigError, match=r"engine.precision='fp16': needs a CUDA device"):
            _resolve(synthetic_data, tmp_path, *fp16)
