"""Name -> backbone factory; one table, explicit imports (no import-time registration)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from partial_fc.backbones import iresnet
from partial_fc.backbones.mobilefacenet import mobilefacenet

_BACKBONES: dict[str, Callable[..., nn.Module]] = {
    "iresnet18": iresnet.iresnet18,
    "iresnet34": iresnet.iresnet34,
    "iresnet50": iresnet.iresnet50,
    "iresnet100": iresnet.iresnet100,
    "iresnet200": iresnet.iresnet200,
    "iresnet_tiny": iresnet.iresnet_tiny,
    "mobilefacenet": mobilefacenet,
}


def list_backbones() -> list[str]:
    """Names accepted by :func:`build_backbone`, sorted."""
    return sorted(_BACKBONES)


def build_backbone(name: str, embedding_size: int = 512, dropout: float = 0.0) -> nn.Module:
    """Build a freshly initialised backbone.

    The model maps float ``[N, 3, 112, 112]`` in [-1, 1] (see :func:`normalize_images`)
    to ``[N, embedding_size]`` un-normalised embeddings.

    Raises:
        ValueError: unknown ``name`` (the message lists the valid names), non-positive
            ``embedding_size`` or ``dropout`` outside [0, 1).
    """
    if name not in _BACKBONES:
        raise ValueError(f"unknown backbone {name!r}; choose one of {', '.join(list_backbones())}")
    if type(embedding_size) is not int or embedding_size < 1:
        raise ValueError(f"embedding_size must be a positive int, got {embedding_size!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    return _BACKBONES[name](embedding_size=embedding_size, dropout=dropout)


def normalize_images(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, 3, H, W]`` in [0, 255] -> float32 in [-1, 1], i.e. ``(x/255 - 0.5)/0.5``.

    Runs on whatever device ``images`` is on, so the loader can ship uint8 and the
    conversion happens on the accelerator.
    """
    if images.dtype != torch.uint8:
        raise TypeError(f"normalize_images expects uint8 images, got dtype {images.dtype}")
    return images.float().div_(127.5).sub_(1.0)
