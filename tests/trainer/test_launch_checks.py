"""What is refused before any process group starts because of the launch's shape (ranks,
classes, batch) and what ``python -m launch.train --check`` (``make <recipe>``'s first
command) answers. Assertions name the key and the exit code, not the wording."""

from __future__ import annotations

import pytest
from launch_helpers import ROOT

from launch.train import main
from trainer.config import ConfigError, load_config

SMOKE = ROOT / "configs" / "smoke.yaml"
SYNTHETIC = ["data.source=synthetic", "data.num_samples=null",
             "data.synthetic_images_per_class=100", "output=/tmp/pfc-launch-checks"]


def _refused_keys(monkeypatch, world: int, *overrides: str) -> set[str]:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    try:
        load_config(SMOKE, [*SYNTHETIC, *overrides])
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
def test_launch_shape_refusals(monkeypatch, world, overrides, refused):
    assert _refused_keys(monkeypatch, world, *overrides) == refused


def _torchrun_env_restored_after(monkeypatch) -> None:
    """``--check`` sets WORLD_SIZE/LOCAL_WORLD_SIZE in this process as torchrun would; the
    monkeypatch puts them back for the tests after this one."""
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "1")  # records the value before (delenv of an absent name
        monkeypatch.delenv(name)  # would record nothing, and --check's value would stay)


def test_check_mode_answers_for_the_launch_it_is_told(monkeypatch, capsys):
    _torchrun_env_restored_after(monkeypatch)
    base = ["--check", "--config", str(SMOKE), *SYNTHETIC, "data.num_classes=3"]
    assert main([*base, "--nproc-per-node", "3"]) == 0
    assert main([*base, "--nproc-per-node", "2", "--nnodes", "2"]) == 2  # 4 ranks, 3 classes
    assert "data.num_classes" in capsys.readouterr().err
    assert main([*base, "--nproc-per-node", "two"]) == 2
    assert "NPROC_PER_NODE" in capsys.readouterr().err


def test_gpu_count_launch_without_a_gpu_is_one_line(monkeypatch, capsys):
    """``make <recipe>`` with its default NPROC_PER_NODE=gpu on a machine with no GPU:
    torchrun would end in a ``ValueError`` traceback."""
    import torch

    _torchrun_env_restored_after(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    rc = main(["--check", "--nproc-per-node", "gpu", "--config", str(SMOKE), *SYNTHETIC,
               "data.num_classes=10"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "NPROC_PER_NODE" in err[0] and "device=cpu" in err[0]


def test_a_gpu_recipe_on_a_cpu_machine_is_refused_not_run_on_the_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    recipe = ROOT / "configs" / "ms1mv3_r50.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(recipe, SYNTHETIC)
    assert "device='cuda'" in str(err.value) and "device=cpu" in str(err.value)
    assert load_config(recipe, [*SYNTHETIC, "device=cpu"]).device == "cpu"  # explicit: allowed
