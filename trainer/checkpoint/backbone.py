"""Load a trained backbone from a run folder or checkpoint for evaluation, export or inference,
and a backbone's initial weights from a local file (``backbone.weights``).

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
from torch import nn

from data_pipeline.store import in_store
from partial_fc.backbones import build_backbone
from trainer.checkpoint import CheckpointError, find_verified
from trainer.yaml_file import YamlRefused, read_mapping


def resolve_checkpoint(path: str | os.PathLike) -> tuple[Path, Path]:
    """``path`` -> ``(RUN/config.yaml, .../backbone.pt)``, both existing, the checkpoint
    verified. Raises :class:`CheckpointError` (one line) when there is none, or none intact.
    A URL (``s3://bucket/runs/a``, its ``checkpoints/<tag>`` or that one's ``backbone.pt``)
    gives the files of a local copy (``trainer.checkpoint.in_store.fetch_checkpoint``)."""
    if in_store(os.fspath(path)):
        from trainer.checkpoint.in_store import fetch_checkpoint

        return fetch_checkpoint(os.fspath(path))
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


def backbone_spec(cfg: dict[str, Any], config_path: Path) -> dict[str, Any]:
    """``build_backbone``'s arguments from the trainer's resolved config (``backbone.name``,
    ``embedding_size``, ``dropout``, the ViT options; no checkpointing: evaluation needs
    none)."""
    section = cfg.get("backbone")
    if not isinstance(section, dict):
        raise CheckpointError(f"{config_path}: no 'backbone' section")
    for key in ("name", "embedding_size"):
        if section.get(key) is None:
            raise CheckpointError(f"{config_path}: missing key backbone.{key}")
    return {"name": section["name"], "embedding_size": section["embedding_size"],
            "dropout": float(section.get("dropout", 0.0)),
            **{k: section.get(k) for k in ("depth", "drop_path", "mask_ratio")}}


def load_initial_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Load ``backbone.weights`` into a freshly built backbone, strictly: the whole backbone's
    state_dict, or for a ``timm:<model>`` backbone the timm model's own (into ``trunk``, the
    embedding layer on top keeps its random initialisation). ``.safetensors`` files need the
    safetensors package; anything else is read with ``torch.load(weights_only=True)``.

    Raises:
        CheckpointError: an unreadable file, or weights that do not fit the model.
    """
    path = Path(path)
    target = getattr(model, "trunk", model)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except ImportError:
        raise CheckpointError(f"backbone.weights={str(path)!r}: reading .safetensors needs "
                              "the safetensors package (pip install safetensors)") from None
    except Exception as exc:  # noqa: BLE001 - torch.load raises many types for a bad file
        raise CheckpointError(f"backbone.weights={str(path)!r}: not a readable state_dict "
                              f"({type(exc).__name__}: {exc})") from None
    try:
        target.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as exc:
        why = " ".join(str(exc).strip().splitlines()[:2])
        raise CheckpointError(f"backbone.weights={str(path)!r}: does not fit the backbone: "
                              f"{why}") from None


def load_backbone(path: str | os.PathLike) -> tuple[nn.Module, dict[str, Any]]:
    """Build the run's backbone, load its weights (``weights_only=True``), return it in eval mode.

    Returns:
        ``(backbone on CPU in eval mode, the run's config as a dict)``.

    Raises:
        CheckpointError: missing files/keys, or weights that do not fit the configured backbone.
    """
    config_path, weights = resolve_checkpoint(path)
    try:
        cfg = read_mapping(config_path)
    except YamlRefused as exc:
        raise CheckpointError(str(exc)) from None
    spec = backbone_spec(cfg, config_path)
    name = spec["name"]
    try:
        model = build_backbone(**spec)
    except ValueError as exc:
        raise CheckpointError(f"{config_path}: {exc}") from exc
    state = torch.load(weights, map_location="cpu", weights_only=True)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        why = " ".join(str(exc).strip().splitlines()[:2])
        raise CheckpointError(f"{weights}: does not fit backbone {name!r}: {why}") from exc
    return model.eval(), cfg
