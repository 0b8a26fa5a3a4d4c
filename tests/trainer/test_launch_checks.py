"""What is refused before any process group starts because of the launch's shape (ranks,
classes, batch) and what ``python -m launch.train --check`` (``make <recipe>``'s first
command) answers. Assertions name the key and the exit code, not the wording."""

from __future__ import annotations

import os

import pytest
from launch_helpers import ROOT

from launch.train import launch_machine, main
from trainer.config import ConfigError, Machine, load_config
from trainer.config.machine import OPTIONAL_PACKAGES

SMOKE = ROOT / "configs" / "smoke.yaml"
SYNTHETIC = ["data.source=synthetic", "data.num_samples=null",
             "data.synthetic_images_per_class=100", "output=/tmp/pfc-launch-checks"]
CPU = Machine(installed=frozenset(OPTIONAL_PACKAGES))  # one CPU rank, every package there


def _refused_keys(world: int, *overrides: str) -> set[str]:
    try:
        load_config(SMOKE, [*SYNTHETIC, *overrides], machine=CPU.launching(1, world))
    except ConfigError as err:
        return {line.split(": ", 1)[1].split("=")[0] for line in str(err).splitlines()}
    return set()


@pytest.mark.parametrize(("world", "overrides", "refused"), [
    (4, ["data.num_classes=3"], {"data.num_classes"}),  # a rank would own no class
    (3, ["data.num_classes=3"], set()),
    (1, ["data.num_classes=1"], {"data.num_classes"}),  # one class: loss 0, nothing trains
    (1, ["data.num_classes=10", "train.batch_size=1"], {"train.batch_size"}),  # BatchNorm1d
    (1, ["data.num_classes=10", "train.batch_size=2"], set()),
    (1, ["data.num_classes=10", "dist.timeout_s=0.001"], {"dist.timeout_s"}),
    (1, ["data.num_classes=10", "dist.timeout_s=5"], set()),
])
def test_launch_shape_refusals(world, overrides, refused):
    assert _refused_keys(world, *overrides) == refused


def test_fewer_classes_than_ranks_is_refused_without_any_environment_variable(monkeypatch):
    """The world size comes from the Machine alone: torchrun's variables, here saying one
    rank, are not read by the checks."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match=r"data.num_classes=3: fewer classes than the 4 ranks"):
        load_config(SMOKE, [*SYNTHETIC, "data.num_classes=3"],
                    machine=Machine(local_ranks=2, world_size=4,
                                    installed=frozenset(OPTIONAL_PACKAGES)))


def test_check_mode_answers_for_the_launch_it_is_told(capsys):
    before = dict(os.environ)
    base = ["--check", "--config", str(SMOKE), *SYNTHETIC, "data.num_classes=3"]
    assert main([*base, "--nproc-per-node", "3"]) == 0
    assert main([*base, "--nproc-per-node", "2", "--nnodes", "2"]) == 2  # 4 ranks, 3 classes
    assert "data.num_classes" in capsys.readouterr().err
    assert main([*base, "--nproc-per-node", "two"]) == 2
    assert "NPROC_PER_NODE" in capsys.readouterr().err
    # an elastic range (torchrun's --nnodes MIN:MAX) is checked for every count in it
    assert main([*base, "--nproc-per-node", "1", "--nnodes", "1:3"]) == 0
    assert main([*base, "--nproc-per-node", "2", "--nnodes", "1:2"]) == 2  # 4 ranks
    assert "data.num_classes" in capsys.readouterr().err
    assert dict(os.environ) == before  # the launch checked is a Machine, not WORLD_SIZE


def test_the_launch_shape_becomes_the_machine_checked():
    gpus = Machine(gpus=4, bf16=True, nccl=True)
    assert launch_machine("gpu", 2, gpus) == Machine(local_ranks=4, world_size=8, gpus=4,
                                                     bf16=True, nccl=True)
    assert launch_machine("3", 1, CPU) == CPU.launching(3)
    assert "a number of ranks per node" in launch_machine("0", 1, CPU)
    no_gpu = launch_machine("gpu", 1, CPU)  # make <recipe>'s default on a machine without one
    assert isinstance(no_gpu, str) and "NPROC_PER_NODE=gpu" in no_gpu and "device=cpu" in no_gpu


def test_gpu_count_launch_without_a_gpu_is_one_line(monkeypatch, capsys):
    """``make <recipe>`` with its default NPROC_PER_NODE=gpu on a machine with no GPU:
    torchrun would end in a ``ValueError`` traceback."""
    monkeypatch.setattr(Machine, "observe", classmethod(lambda cls, *a, **k: CPU))
    rc = main(["--check", "--nproc-per-node", "gpu", "--config", str(SMOKE), *SYNTHETIC,
               "data.num_classes=10"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "NPROC_PER_NODE" in err[0] and "device=cpu" in err[0]


def test_a_gpu_recipe_on_a_cpu_machine_is_refused_not_run_on_the_cpu():
    recipe = ROOT / "configs" / "ms1mv3_r50.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(recipe, SYNTHETIC, machine=CPU)
    assert "device='cuda'" in str(err.value) and "device=cpu" in str(err.value)
    assert load_config(recipe, [*SYNTHETIC, "device=cpu"], machine=CPU).device == "cpu"
