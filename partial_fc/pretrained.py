"""A backbone as a shippable folder: ``model.safetensors`` plus ``config.json``.

``config.json`` says everything a user needs to get the same embeddings without this
project's trainer: the architecture (a :func:`partial_fc.backbones.build_backbone` name),
the embedding size, the input (size, channel order, ``(pixel - mean) / std``) and whether
the published figures used flip test-time augmentation (embedding of the image plus its
mirror). ``trainer.pretrained.load_pretrained(folder)`` gives the backbone back, with no run
folder or YAML: it reads ``config.json`` through the project's one door for files
(``data_pipeline.door``), which ``partial_fc`` does not import, and hands its value to
:meth:`PretrainedConfig.from_dict` and the config to :func:`build_pretrained`. The model card
beside them (``README.md``) is the exporter's business.

safetensors holds tensors only (no pickle), so a folder from a stranger is safe to read.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from safetensors.torch import save_model
from torch import nn

from partial_fc.backbones import build_backbone

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class PretrainedConfig:
    """``config.json``: what rebuilds the backbone and what its input must be.

    The input is uint8 RGB ``[N, 3, H, W]`` turned into ``(pixel - mean) / std`` per channel,
    i.e. [-1, 1] for the project's ``partial_fc.backbones.normalize_images``.
    """

    architecture: str  # build_backbone's name
    embedding_size: int
    depth: int | None = None  # vit_* blocks, when not the architecture's own
    input_size: tuple[int, int] = (112, 112)  # (height, width) of the aligned face
    channel_order: str = "RGB"
    mean: tuple[float, float, float] = (127.5, 127.5, 127.5)  # in uint8 pixel units
    std: tuple[float, float, float] = (127.5, 127.5, 127.5)
    flip_tta: bool = True  # evaluation embeds x and its mirror and sums them
    library: str = "partial-fc"
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)  # anything else the exporter records

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, raw: object, where: str) -> PretrainedConfig:
        """``config.json``'s top-level value (its caller parsed it); raises ValueError (one
        line naming ``where``) when it is not one of ours or misses a key."""
        if not isinstance(raw, dict) or raw.get("library") != "partial-fc":
            raise ValueError(f"{where}: not a partial-fc config.json (no \"library\": "
                             "\"partial-fc\"); write one with python -m launch.export "
                             "--format safetensors")
        if raw.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{where}: format_version {raw.get('format_version')!r}, this "
                             f"partial-fc reads {FORMAT_VERSION}")
        known = set(cls.__dataclass_fields__)
        missing = [k for k in ("architecture", "embedding_size") if k not in raw]
        if missing:
            raise ValueError(f"{where}: missing key {missing[0]!r}")
        values = {k: v for k, v in raw.items() if k in known}
        for key in ("input_size", "mean", "std"):
            if key in values:
                values[key] = tuple(values[key])
        return cls(**values)


def save_pretrained(backbone: nn.Module, folder: str | os.PathLike,
                    config: PretrainedConfig) -> Path:
    """Write ``backbone``'s weights and ``config`` into ``folder`` (created); returns it.

    ``save_model`` rather than ``save_file``: it stores tied tensors once and makes every
    tensor contiguous (a channels_last backbone's convolutions are not)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_model(backbone, str(folder / WEIGHTS_FILE))
    (folder / CONFIG_FILE).write_text(config.to_json())
    return folder


def build_pretrained(config: PretrainedConfig) -> nn.Module:
    """The backbone ``config`` names, untrained; ``trainer.pretrained.load_pretrained`` puts
    the folder's weights in."""
    return build_backbone(config.architecture, embedding_size=config.embedding_size,
                          depth=config.depth)
