"""Load a trained backbone from a run folder or checkpoint for evaluation, export or inference.

Run-folder layout written by ``launch.train``::

    RUN/config.yaml                         fully resolved config
    RUN/checkpoints/latest                  text file: the newest <tag>
    RUN/checkpoints/<tag>/backbone.pt       plain backbone state_dict (weights_only-safe)

Accepted paths: ``RUN``, ``RUN/checkpoints/<tag>`` or ``RUN/checkpoints/<tag>/backbone.pt``;
the config is found at ``RUN/config.yaml``. The checkpoint is resolved and verified as
training's resume does it (``trainer.checkpoint.find_verified``: every file listed in its
``meta.json``, and ``backbone.pt``, the one file read here, matching its SHA-256 before it is
unpickled; the head's rows and optimizer state are not hashed): for ``RUN``, ``latest``'s
target or, when that one fails verification, the newest intact one, with a warning; a
checkpoint named explicitly is refused when it does not verify.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from partial_fc.backbones import build_backbone
from trainer.checkpoint import CheckpointError, find_verified


def resolve_checkpoint(path: str | os.PathLike) -> tuple[Path, Path]:
    """``path`` -> ``(RUN/config.yaml, .../backbone.pt)``, both existing, the checkpoint
    verified. Raises :class:`CheckpointError` (one line) when there is none, or none intact."""
    path = Path(path)
    if path.is_file() and path.name != "backbone.pt":
        raise CheckpointError(f"{path}: not a backbone.pt (expected RUN, RUN/checkpoints/<tag> "
                              "or RUN/checkpoints/<tag>/backbone.pt)")
    folder = find_verified(path.parent if path.is_file() else path, only=("backbone.pt",))
    if folder is None:
        what = "no checkpoint there" if path.exists() else "no such folder"
        raise CheckpointError(f"{path}: {what} (give the `output` folder of launch.train, e.g. "
                              "runs/smoke after `make train`, or RUN/checkpoints/<tag>)")
    weights = folder / "backbone.pt"
    if not weights.is_file():
        raise CheckpointError(f"{weights}: no such backbone checkpoint")
    config = folder.parent.parent / "config.yaml"
    if not config.is_file():
        raise CheckpointError(f"{config}: missing (expected RUN/checkpoints/<tag>/backbone.pt)")
    return config, weights


def backbone_spec(cfg: dict[str, Any], config_path: Path) -> tuple[str, int, float]:
    """``(name, embedding_size, dropout)`` from the trainer's resolved config
    (``backbone.name``, ``backbone.embedding_size``, ``backbone.dropout``)."""
    section = cfg.get("backbone")
    if not isinstance(section, dict):
        raise CheckpointError(f"{config_path}: no 'backbone' section")
    for key in ("name", "embedding_size"):
        if section.get(key) is None:
            raise CheckpointError(f"{config_path}: missing key backbone.{key}")
    return section["name"], section["embedding_size"], float(section.get("dropout", 0.0))


def load_backbone(path: str | os.PathLike) -> tuple[nn.Module, dict[str, Any]]:
    """Build the run's backbone, load its weights (``weights_only=True``), return it in eval mode.

    Returns:
        ``(backbone on CPU in eval mode, the run's config as a dict)``.

    Raises:
        CheckpointError: missing files/keys, or weights that do not fit the configured backbone.
    """
    config_path, weights = resolve_checkpoint(path)
    cfg = yaml.safe_load(config_path.read_text()) or {}
    name, embedding_size, dropout = backbone_spec(cfg, config_path)
    try:
        model = build_backbone(name, embedding_size=embedding_size, dropout=dropout)
    except ValueError as exc:
        raise CheckpointError(f"{config_path}: {exc}") from exc
    state = torch.load(weights, map_location="cpu", weights_only=True)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        why = " ".join(str(exc).strip().splitlines()[:2])
        raise CheckpointError(f"{weights}: does not fit backbone {name!r}: {why}") from exc
    return model.eval(), cfg
