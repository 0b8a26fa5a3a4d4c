"""The GPU path's refusals, checked on CPU against the snapshot of a GPU machine.

Each is one line naming the fix, found while the config is resolved, before any process group.
The checks read the machine only through the :class:`Machine` they are given, so each test
states the machine it means (GPUs, bf16, NCCL, the launch's ranks); nothing of torch is faked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import ConfigError, Machine, load_config

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
ALL_PACKAGES = frozenset({"deepspeed", "wandb", "tensorboard", "triton"})


def gpu_machine(gpus=1, bf16=True, nccl=True, local_ranks=1, world=1, installed=ALL_PACKAGES):
    """What torch and torchrun would report on a node with ``gpus`` GPUs."""
    return Machine(local_ranks=local_ranks, world_size=world, gpus=gpus, bf16=bf16, nccl=nccl,
                   installed=installed)


def _resolve(machine: Machine, data: Path, tmp_path: Path, *overrides: str):
    return load_config(SMOKE, [f"data.dir={data}", f"output={tmp_path / 'run'}",
                               "log.wandb=disabled", *overrides], machine=machine)


def test_one_rank_per_gpu_passes(synthetic_data, tmp_path):
    m = gpu_machine(gpus=2, local_ranks=2, world=2)
    gpu_bf16 = ("device=cuda", "engine.precision=bf16", "engine.zero_stage=1")
    _resolve(m, synthetic_data, tmp_path, *gpu_bf16)  # accepted: a refusal raises ConfigError
    m = gpu_machine(gpus=2, local_ranks=3, world=3)  # one rank more than GPUs: refused
    with pytest.raises(ConfigError, match="3 ranks on this node but 2 GPU"):
        _resolve(m, synthetic_data, tmp_path, *gpu_bf16)


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_more_ranks_than_gpus_is_refused(synthetic_data, tmp_path, device):
    m = gpu_machine(gpus=1, local_ranks=2, world=2)
    with pytest.raises(ConfigError) as err:
        _resolve(m, synthetic_data, tmp_path, f"device={device}")
    line = next(x for x in str(err.value).splitlines() if "ranks on this node" in x)
    assert "2 ranks on this node but 1 GPU(s)" in line and "--nproc_per_node 1" in line


def test_bf16_on_a_gpu_without_it_is_refused(synthetic_data, tmp_path):
    m = gpu_machine(gpus=1, bf16=False)
    with pytest.raises(ConfigError, match=r"engine.precision='bf16': this GPU has no bf16"):
        _resolve(m, synthetic_data, tmp_path, "device=cuda", "engine.precision=bf16",
                 "engine.zero_stage=1")


def test_several_gpu_ranks_without_nccl_are_refused(synthetic_data, tmp_path):
    m = gpu_machine(gpus=2, nccl=False, local_ranks=2, world=2)
    with pytest.raises(ConfigError, match=r"no NCCL"):
        _resolve(m, synthetic_data, tmp_path, "device=cuda")


def test_cpu_runs_ignore_the_gpus(synthetic_data, tmp_path):
    m = gpu_machine(gpus=1, bf16=False, nccl=False, local_ranks=4, world=4)
    _resolve(m, synthetic_data, tmp_path, "device=cpu")  # accepted: a refusal raises ConfigError
    with pytest.raises(ConfigError, match="4 ranks on this node but 1 GPU"):  # on the GPU: not
        _resolve(m, synthetic_data, tmp_path, "device=cuda")


def test_missing_deepspeed_is_a_config_error(synthetic_data, tmp_path):
    m = gpu_machine(gpus=0, installed=ALL_PACKAGES - {"deepspeed"})
    with pytest.raises(ConfigError, match=r"partial-fc\[deepspeed\]"):
        _resolve(m, synthetic_data, tmp_path, "engine.type=deepspeed")
    _resolve(m, synthetic_data, tmp_path, "engine.type=ddp")  # DDP needs no DeepSpeed: accepted


def test_cuda_without_a_gpu_is_refused(synthetic_data, tmp_path):
    m = gpu_machine(gpus=0)
    with pytest.raises(ConfigError, match=r"device='cuda': no CUDA device on this machine"):
        _resolve(m, synthetic_data, tmp_path, "device=cuda")


@pytest.mark.parametrize("gpus", [0, 1])
def test_fp16_needs_a_gpu(synthetic_data, tmp_path, gpus):
    """``device=auto`` trains on the GPU when torch sees one: fp16 is accepted there only."""
    m = gpu_machine(gpus=gpus)
    fp16 = ("device=auto", "engine.type=deepspeed", "engine.precision=fp16")
    if gpus:
        _resolve(m, synthetic_data, tmp_path, *fp16)  # accepted: a refusal raises ConfigError
    else:
        with pytest.raises(ConfigError, match=r"engine.precision='fp16': needs a CUDA device"):
            _resolve(m, synthetic_data, tmp_path, *fp16)


def test_missing_triton_is_refused_for_the_triton_tiles_only(synthetic_data, tmp_path):
    m = gpu_machine(gpus=1, installed=ALL_PACKAGES - {"triton"})
    with pytest.raises(ConfigError, match=r"head.kernel='triton': triton is not installed"):
        _resolve(m, synthetic_data, tmp_path, "device=cuda", "head.kernel=triton")
    _resolve(m, synthetic_data, tmp_path, "device=cuda")  # head.kernel=auto: accepted
