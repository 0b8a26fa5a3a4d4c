"""The distill section: one teacher source, a data set its keys can join, and a teacher
width the loss can compare; each refusal one line naming the key."""

from __future__ import annotations

import pytest
import torch
from eval_helpers import make_run
from launch_helpers import make_config

from trainer.config import ConfigError
from trainer.distill import Distillation, load_teacher


@pytest.mark.parametrize("overrides,fragment", [
    (["distill.embeddings=e", "distill.teacher=t"], "distill.embeddings and distill.teacher"),
    (["distill.embeddings=e", "data.source=synthetic"], "needs data.source=shards"),
    (["distill.loss=kl", "distill.teacher=t"], "distill.loss"),
])
def test_bad_distill_sections(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        make_config(*overrides)


def test_online_teacher_width_must_fit_a_coordinate_loss(tmp_path):
    run = make_run(tmp_path, embedding_size=16)  # the student's backbone is 16-d
    for loss, width in (("cosine", 16), ("l2", 16), ("similarity", 128)):
        made = Distillation.from_config(
            make_config(f"distill.teacher={run}", f"distill.loss={loss}",
                        f"backbone.embedding_size={width}"), torch.device("cpu"))
        assert made.online is not None and made.offline is None
    with pytest.raises(ConfigError, match="16-d, the student's backbone.embedding_size=128"):
        Distillation.from_config(make_config(f"distill.teacher={run}",
                                             "backbone.embedding_size=128"), torch.device("cpu"))
    assert Distillation.from_config(make_config(), torch.device("cpu")) is None


def test_a_teacher_that_is_not_there_is_one_line(tmp_path):
    for path in (tmp_path / "nothing.onnx", tmp_path / "no_run"):
        with pytest.raises(ValueError) as caught:
            load_teacher(path)
        assert len(str(caught.value).splitlines()) == 1 and str(path) in str(caught.value)


def test_head_init_points_each_class_row_at_its_teacher_mean(tmp_path):
    import torch.nn.functional as F

    from data_pipeline import write_synthetic_dataset
    from data_pipeline.tar_reader import tar_samples
    from offline.embedding_sets import embed_shards
    from partial_fc import PartialFC, build_margin
    from trainer.checkpoint.backbone import load_backbone
    from trainer.teacher_embeddings import TeacherEmbeddings

    data, stored = tmp_path / "data", tmp_path / "emb"
    manifest = write_synthetic_dataset(data, num_classes=5, images_per_class=3)
    run = make_run(tmp_path, embedding_size=16)
    embed_shards(load_backbone(run)[0], "t", data, stored, flip=False)
    cfg = make_config(f"data.dir={data}", "data.num_classes=5", f"distill.embeddings={stored}",
                      "distill.head_init=true", "backbone.embedding_size=16")
    head = PartialFC(16, 5, build_margin({"type": "arcface"}))
    before = head.weight.detach().clone()
    Distillation.from_config(cfg, torch.device("cpu")).init_head(head, data)

    table = TeacherEmbeddings(stored)
    labels = {s["__key__"]: int(s["cls"]) for shard in manifest.shards
              for s in tar_samples(data / shard.name, exts=("cls",))}
    for c in range(5):
        keys = [k for k, label in labels.items() if label == c]
        mean = F.normalize(table.lookup(keys, None), dim=1).mean(0)
        assert F.cosine_similarity(head.weight[c], mean, dim=0) > 1 - 1e-5
        assert torch.allclose(head.weight[c].norm(), before[c].norm())
    with pytest.raises(ConfigError, match="distill.head_init"):
        make_config("distill.teacher=t", "distill.head_init=true")
