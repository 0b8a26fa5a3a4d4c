"""``data.dirs`` and ``data.exclude`` in a training run: two folders with their own labels
(one class space), an exclusion list on one (and a shard of it without its member index),
and a run stopped and resumed that ends where an unbroken one ends."""

from __future__ import annotations

import torch
from launch_helpers import ROOT
from shard_helpers import make_shards

from data_pipeline.exclusion import Exclusions, write_exclusions
from data_pipeline.shard_index import index_path


def _train(run, dirs, exclude, *overrides: str) -> int:
    from launch.train import main

    return main(["--config", str(ROOT / "configs" / "smoke.yaml"), f"data.dirs=[{dirs}]",
                 f"data.exclude=[null, {exclude}]", "data.weights=[3, 1]", f"output={run}",
                 "engine.type=ddp", "train.batch_size=8", "data.num_workers=0", "log.every=1",
                 "log.progress=false", "checkpoint.every=2", "log.wandb=disabled", *overrides])


def test_two_folders_train_exclude_and_resume_exactly(synthetic_data, tmp_path, capsys):
    other = make_shards(tmp_path / "other", [5, 4], num_classes=3)
    index_path(other / "shard-000001.tar").unlink()  # read by parsing the tar, and said so
    exclude = tmp_path / "x.txt"
    write_exclusions(exclude, Exclusions(classes=frozenset({2})))  # 3 of its 9 samples
    # a batch of 8 = 6 + 2: the second folder's epoch (3 batches) ends inside the resumed part
    dirs = f"{synthetic_data}, {other}"
    assert _train(tmp_path / "whole", dirs, exclude, "train.max_steps=4") == 0
    out = capsys.readouterr()
    assert "C=23" in out.out + out.err and "excluded 3 samples" in out.out + out.err
    assert "1 shard(s) without a member index" in out.out + out.err
    assert _train(tmp_path / "cut", dirs, exclude, "train.max_steps=2") == 0
    assert _train(tmp_path / "cut", dirs, exclude, "train.max_steps=4") == 0
    assert "resumed from" in "".join(capsys.readouterr())
    whole, cut = (torch.load(tmp_path / r / "checkpoints" / "step-00000004" / "backbone.pt",
                             weights_only=True) for r in ("whole", "cut"))
    assert whole.keys() == cut.keys()
    for key, value in whole.items():
        assert torch.equal(cut[key], value), key
