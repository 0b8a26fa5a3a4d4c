"""The ``distill`` section at run time: where the teacher's embeddings come from.

Two sources give the engine the same thing, the teacher's embedding of each image the
student sees (mirrored where the student's is):

- offline (``distill.embeddings``): the folder ``python -m launch.embed`` wrote, looked up
  by the batch's sample keys and flip bits (:class:`trainer.teacher_embeddings.TeacherEmbeddings`);
  the shard loader hands the keys out with the batch (``with_keys``);
- online (``distill.teacher``): the teacher itself, run by the engine on the normalised input
  of the student (a run's backbone in eval mode, or an ONNX file through ONNX Runtime).

The losses are ``partial_fc.distill``'s; the teacher is frozen and never trained.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from data_pipeline.tar_reader import tar_samples
from trainer.checkpoint import CheckpointError
from trainer.checkpoint.backbone import load_backbone
from trainer.config import Config, ConfigError
from trainer.onnx_backbone import OnnxBackbone
from trainer.teacher_embeddings import TeacherEmbeddings

TeacherError = CheckpointError  # a teacher that cannot be read is a checkpoint that cannot


def load_teacher(path: str | os.PathLike) -> nn.Module:
    """A teacher backbone, frozen, in eval mode: an ``.onnx`` file, or a partial-fc run (a
    converted arcface_torch run is one) as ``trainer.checkpoint.backbone`` resolves it."""
    if Path(path).suffix == ".onnx":
        path = Path(path)
        if not path.is_file():
            raise TeacherError(f"{path}: no such ONNX file")
        try:
            model = OnnxBackbone(path)
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises its own types
            raise TeacherError(f"{path}: not a loadable ONNX model ({exc})") from None
    else:  # a path or a URL
        model = load_backbone(path)[0]
    return model.eval().requires_grad_(False)


@dataclass
class Distillation:
    """What the engine needs: the loss, its weight, and one of the two teacher sources."""

    loss: str
    weight: float
    offline: TeacherEmbeddings | None = None
    online: nn.Module | None = None

    @classmethod
    def from_config(cls, cfg: Config, device: torch.device) -> Distillation | None:
        """None when ``distill`` is off. Raises ConfigError when the teacher's width cannot
        serve ``distill.loss`` (cosine and l2 compare coordinates: equal widths)."""
        d = cfg.distill
        if not d.enabled:
            return None
        if d.embeddings is not None:
            made = cls(d.loss, d.weight, offline=TeacherEmbeddings(d.embeddings))
            width = made.offline.embedding_size
        else:
            teacher = load_teacher(d.teacher).to(device)
            made = cls(d.loss, d.weight, online=teacher)
            with torch.no_grad():
                width = int(teacher(torch.zeros(1, 3, 112, 112, device=device)).shape[1])
        if (d.loss != "similarity" or d.head_init) and width != cfg.backbone.embedding_size:
            key = "distill.head_init" if d.head_init else f"distill.loss={d.loss!r}"
            raise ConfigError(f"{key}: the teacher's embeddings are {width}-d,"
                              f" the student's backbone.embedding_size="
                              f"{cfg.backbone.embedding_size} (use distill.loss=similarity, "
                              "or a student of the teacher's width)")
        return made

    @torch.no_grad()
    def init_head(self, head: nn.Module, data_dir: str | Path) -> None:
        """``distill.head_init``: each of this rank's class rows of ``head`` (a
        ``partial_fc.PartialFC`` without sub-centres) turned towards the mean of its
        samples' unit teacher embeddings (plain view), keeping the row's initial norm, so
        the margin loss starts in the teacher's embedding space. A class without samples
        keeps its random row. Labels are read from the shards' ``.cls`` members."""
        centres = torch.zeros(head.num_local, self.offline.embedding_size)
        stop = head.class_start + head.num_local
        keys, labels = [], []
        for name, _ in self.offline.index["data"]["shards"]:
            for sample in tar_samples(Path(data_dir) / name, exts=("cls",)):
                label = int(sample["cls"])
                if head.class_start <= label < stop and sample["__key__"] in self.offline:
                    keys.append(sample["__key__"])
                    labels.append(label - head.class_start)
        if keys:
            unit = F.normalize(self.offline.lookup(keys, None).float(), dim=1)
            centres.index_add_(0, torch.tensor(labels), unit)
        weight = head.weight
        norms = weight.float().norm(dim=1, keepdim=True)
        seen = centres.norm(dim=1) > 0
        rows = F.normalize(centres[seen], dim=1).to(weight.device) * norms[seen]
        weight[seen] = rows.to(weight.dtype)

    def split(self, batch: tuple) -> tuple[tuple, Tensor | None]:
        """A loader batch -> ``(the batch the engine takes, the teacher's embeddings or None)``:
        offline, the keys (last) come off and are looked up with the flip bits (third, when the
        flip is deferred)."""
        if self.offline is None:
            return batch, None
        *batch, keys = batch
        flips = batch[2] if len(batch) == 3 else None
        return tuple(batch), self.offline.lookup(keys, flips)

    @torch.no_grad()
    def teacher(self, x: Tensor, stored: Tensor | None) -> Tensor:
        """``[n, D_t]`` fp32 on ``x``'s device: ``stored`` (offline), else the online teacher
        on ``x`` (the student's normalised, mirrored input)."""
        if stored is not None:
            return stored.to(x.device, torch.float32, non_blocking=True)
        return self.online(x.float()).float()
