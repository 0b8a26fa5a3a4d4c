"""What the project writes as an input to itself is read back by ``launch.train``: a run
folder's ``config.yaml`` resumes and fine-tunes on shards, on 1 and 2 ranks, and the command
``launch.convert insightface-checkpoint`` prints runs once its placeholder names a shard
folder (docs/insightface.md's three commands walk the same road)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.convert import main as convert
from launch.train import main as train
from tests.launch_helpers import ROOT, train_in_process
from tests.offline.test_insightface_import import C, write_arcface_torch_run

SMALL = ["train.batch_size=8", "data.num_workers=0", "log.progress=false", "log.every=1"]


def _torchrun(args: list[str]) -> str:
    """``torchrun --standalone --nproc_per_node 2 -m launch.train ARGS``; its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "-m", "launch.train", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return out


def _latest(run: Path) -> str:
    return (run / "checkpoints" / "latest").read_text().strip()


def _printed_command(lines: str, shards: Path) -> list[str]:
    """The ``python -m launch.train ...`` a converter printed, its placeholder replaced."""
    line = next(x for x in lines.splitlines() if "python -m launch.train" in x)
    words = line.split("python -m launch.train", 1)[1].split()
    return [w.replace("YOUR_SHARDS", str(shards)) for w in words]


def test_a_run_folders_config_yaml_passes_the_check_as_written(tmp_path, synthetic_data):
    """Every key spelled out, defaults included (``data.synthetic_images_per_class``,
    ``data.dir``), with data.dir or data.dirs given after it; ``key=null`` gives a key that
    cannot be null its default back."""
    run = tmp_path / "run"
    assert train_in_process(synthetic_data, run, "train.max_steps=1") == 0
    config = str(run / "config.yaml")
    for extra in ([f"data.dir={synthetic_data}"], [f"data.dirs=[{synthetic_data}]"],
                  ["data.synthetic_images_per_class=null", "train.batch_size=null"]):
        assert train(["--check", "--config", config, *extra]) == 0, extra


def test_a_non_default_setting_with_shards_is_still_named(tmp_path, synthetic_data, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base: {ROOT / 'configs' / 'smoke.yaml'}\n"
                      "data:\n  synthetic_images_per_class: 7\n")
    assert train(["--check", "--config", str(recipe), f"data.dir={synthetic_data}"]) == 2
    err = capsys.readouterr().err
    assert "r.yaml: data.synthetic_images_per_class=7: only read with data.source=synthetic" \
        in err and "=null for its default" in err


@pytest.mark.slow
def test_a_run_resumes_from_its_config_yaml_on_one_and_two_ranks(tmp_path, synthetic_data):
    run = tmp_path / "run"
    assert train_in_process(synthetic_data, run, "train.max_steps=2") == 0
    config = ["--config", str(run / "config.yaml"), f"data.dir={synthetic_data}"]
    assert train([*config, "train.max_steps=3"]) == 0
    assert _latest(run) == "step-00000003"
    out = _torchrun([*config, "train.max_steps=4"])
    assert "at step 3 (saved on 1 ranks)" in out and _latest(run) == "step-00000004"


@pytest.mark.slow
def test_an_imported_run_resumes_with_the_printed_command(tmp_path, capsys):
    """insightface-checkpoint's ``resume on any number of ranks:`` line, YOUR_SHARDS a shard
    folder of the same classes: 1 rank in this process, then 2 torchrun ranks."""
    from data_pipeline import write_synthetic_dataset

    src, out, shards = tmp_path / "arcface", tmp_path / "imported", tmp_path / "shards"
    write_arcface_torch_run(src, 2)
    write_synthetic_dataset(shards, num_classes=C, images_per_class=4, seed=0)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text("backbone:\n  name: iresnet_tiny\n")
    assert convert(["insightface-checkpoint", str(src), str(out), "--config", str(recipe)]) == 0
    command = _printed_command(capsys.readouterr().out, shards)
    assert train([*command, *SMALL, "train.max_steps=8"]) == 0
    assert "at step 6 (saved on 1 ranks)" in capsys.readouterr().err
    # config.yaml now records the run that stopped at 8 (the run rewrites it)
    printed = _torchrun([*command, *SMALL, "train.max_steps=10"])
    assert "at step 8 (saved on 1 ranks)" in printed and _latest(out) == "step-00000010"


@pytest.mark.slow
def test_a_model_alone_fine_tunes_on_another_class_count(tmp_path, capsys):
    """model.pt with its ``.py`` config (1000 classes): the printed fine-tune command trains a
    new head on a 23-class shard folder; the old class count is not the new data's."""
    from data_pipeline import write_synthetic_dataset

    src, out, shards = tmp_path / "arcface", tmp_path / "model", tmp_path / "shards"
    write_arcface_torch_run(src, 1, network="iresnet18")
    (src / "checkpoint_gpu_0.pt").unlink()  # model.pt alone
    write_synthetic_dataset(shards, num_classes=C, images_per_class=4, seed=0)
    config = tmp_path / "configs" / "tiny.py"
    config.parent.mkdir()
    config.write_text("config = dict()\nconfig.num_classes = 1000\nconfig.num_image = 5000\n"
                      "config.embedding_size = 16\nconfig.network = 'r18'\n")
    assert convert(["insightface-checkpoint", str(src), str(out), "--config", str(config)]) == 0
    command = _printed_command(capsys.readouterr().out, shards)
    assert train([*command, *SMALL, "train.max_steps=2"]) == 0
    assert _latest(out / "finetune") == "step-00000002"
