"""``data.merge`` in a training run: the merged class space is the run's (the log's C, the
head, config.yaml's digest, the list copied into the run folder, launch.plan's classes), a
merged run stopped and resumed ends where an unbroken one ends, and a resume with another
list, or a list with a bad line at ``--check``, is refused in one line."""

from __future__ import annotations

import torch
from launch_helpers import ROOT
from shard_helpers import make_shards

from data_pipeline.merge import content_of, read_merge, write_merge
from offline.plan_inputs import resolve_inputs
from trainer.config import load_config


def _train(run, dirs, merge, *overrides: str) -> int:
    from launch.train import main

    return main(["--config", str(ROOT / "configs" / "smoke.yaml"), f"data.dirs=[{dirs}]",
                 f"data.merge={merge}", f"output={run}", "engine.type=ddp",
                 "train.batch_size=8", "data.num_workers=0", "log.every=1",
                 "log.progress=false", "checkpoint.every=2", "log.wandb=disabled", *overrides])


def _lists(tmp_path, first, other):
    """Two lists over the same folders, each joining two classes of the synthetic set's with
    two of the other's: the same class count, other people."""
    paths = []
    for name, pairs in (("merge.txt", [((0, 1), (1, 0)), ((0, 2), (1, 1))]),
                        ("other.txt", [((0, 5), (1, 0)), ((0, 6), (1, 2))])):
        write_merge(tmp_path / name, [str(first), str(other)],
                    [content_of(first), content_of(other)],
                    [(a, b, 0.9, "") for a, b in pairs], header="made by the test")
        paths.append(tmp_path / name)
    return paths


def test_a_merged_run_trains_one_class_per_person_and_resumes_exactly(synthetic_data,
                                                                       tmp_path, capsys):
    other = make_shards(tmp_path / "other", [5, 4], num_classes=3)
    merge, changed = _lists(tmp_path, synthetic_data, other)
    (tmp_path / "struck.txt").write_text(merge.read_text() + "- pair 0:3 1:2 0.5  # no\n")
    dirs = f"{synthetic_data}, {other}"
    assert _train(tmp_path / "whole", dirs, tmp_path / "struck.txt", "train.max_steps=4") == 0
    out = "".join(capsys.readouterr())
    assert "C=21" in out  # 20 + 3 classes, two pairs joined (the struck one is not)
    saved = load_config(tmp_path / "whole" / "config.yaml", resolve=False)
    assert saved.data.num_classes == 21
    assert saved.data.merge_digest == read_merge(merge).digest  # struck lines do not count
    assert (tmp_path / "whole" / "merge.txt").read_text().endswith("# no\n")
    recipe = tmp_path / "recipe.yaml"  # launch.plan counts people too
    recipe.write_text(f"base: {ROOT / 'configs' / 'smoke.yaml'}\ndata:\n  dirs: [{dirs}]\n"
                      f"  merge: {merge}\n")
    assert resolve_inputs(str(recipe), {}).classes == 21

    assert _train(tmp_path / "cut", dirs, merge, "train.max_steps=2") == 0
    assert _train(tmp_path / "cut", dirs, merge, "train.max_steps=4") == 0
    assert "resumed from" in "".join(capsys.readouterr())
    whole, cut = (torch.load(tmp_path / r / "checkpoints" / "step-00000004" / "backbone.pt",
                             weights_only=True) for r in ("whole", "cut"))
    for key, value in whole.items():
        assert torch.equal(cut[key], value), key

    assert _train(tmp_path / "cut", dirs, changed, "train.max_steps=6") != 0
    err = [line for line in capsys.readouterr().err.splitlines()
           if line and not line.startswith("warning:")]
    assert len(err) == 1 and "trained as another model: data.merge_digest" in err[0], err


def test_check_names_the_bad_line_of_a_merge_list(synthetic_data, tmp_path, capsys):
    from launch.train import main

    bad = tmp_path / "merge.txt"
    bad.write_text(f"set 0 {synthetic_data}\npair 0:1 0:2\npair 0:1 0-3\n")
    rc = main(["--check", "--config", str(ROOT / "configs" / "smoke.yaml"),
               f"data.dirs=[{synthetic_data}]", f"data.merge={bad}", "engine.type=ddp"])
    err = capsys.readouterr().err
    assert rc != 0 and f"{bad}:3: '0-3' is not SET:CLASS" in err
    assert len([line for line in err.splitlines() if "data.merge" in line]) == 1
