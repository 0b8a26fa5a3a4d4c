"""Name -> backbone factory; one table, explicit imports (no import-time registration)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from partial_fc.backbones import iresnet, vit
from partial_fc.backbones.checkpointing import checkpoint_errors
from partial_fc.backbones.mbf import mbf, mbf_large
from partial_fc.backbones.mobilefacenet import mobilefacenet
from partial_fc.backbones.timm_adapter import PREFIX as TIMM_PREFIX
from partial_fc.backbones.timm_adapter import build_timm

_BACKBONES: dict[str, Callable[..., nn.Module]] = {
    "iresnet18": iresnet.iresnet18,
    "iresnet34": iresnet.iresnet34,
    "iresnet50": iresnet.iresnet50,
    "iresnet100": iresnet.iresnet100,
    "iresnet200": iresnet.iresnet200,
    "iresnet_tiny": iresnet.iresnet_tiny,
    "mobilefacenet": mobilefacenet,
    "mbf": mbf,
    "mbf_large": mbf_large,
    "vit_t": vit.vit_t,
    "vit_s": vit.vit_s,
    "vit_b": vit.vit_b,
    "vit_l": vit.vit_l,
    "vit_h": vit.vit_h,
}
# What each option applies to (a factory of another name refuses it).
CHECKPOINTING = frozenset(n for n in _BACKBONES if n.startswith(("iresnet", "vit_")))
DEPTH = frozenset(n for n in _BACKBONES if n.startswith("vit_"))  # also drop_path, mask_ratio


def list_backbones() -> list[str]:
    """Names accepted by :func:`build_backbone`, sorted (besides ``timm:<model>``)."""
    return sorted(_BACKBONES)


def backbone_errors(name: str, embedding_size: int = 512, dropout: float = 0.0, *,
                    checkpointing: int = 0, depth: int | None = None,
                    drop_path: float | None = None, mask_ratio: float | None = None
                    ) -> list[str]:
    """Why :func:`build_backbone` would refuse these arguments, one line each (empty when it
    builds; a ``timm:`` name is checked only when built, as timm may be absent here)."""
    out = []
    timm = name.startswith(TIMM_PREFIX)
    if name not in _BACKBONES and not timm:
        out.append(f"unknown backbone {name!r}; choose one of {', '.join(list_backbones())} "
                   f"or {TIMM_PREFIX}<model>")
    if type(embedding_size) is not int or embedding_size < 1:
        out.append(f"embedding_size must be a positive int, got {embedding_size!r}")
    if not 0.0 <= dropout < 1.0:
        out.append(f"dropout must be in [0, 1), got {dropout!r}")
    out += checkpoint_errors(checkpointing)
    if checkpointing and name not in CHECKPOINTING and not out:
        out.append(f"checkpointing={checkpointing}: {name!r} has no checkpointed blocks "
                   f"(iresnet* and vit_* have; 0 turns it off)")
    if depth is not None and (type(depth) is not int or depth < 1 or name not in DEPTH):
        out.append(f"depth={depth!r}: a positive block count for vit_* only (null: the "
                   "architecture's own)")
    for key, rate in (("drop_path", drop_path), ("mask_ratio", mask_ratio)):
        if rate is not None and not (0.0 <= rate < 1.0 and name in DEPTH):
            out.append(f"{key}={rate!r}: a rate in [0, 1) for vit_* only (null: the "
                       "architecture's own)")
    return out


def build_backbone(name: str, embedding_size: int = 512, dropout: float = 0.0, *,
                   checkpointing: int = 0, depth: int | None = None,
                   drop_path: float | None = None, mask_ratio: float | None = None
                   ) -> nn.Module:
    """Build a freshly initialised backbone.

    The model maps float ``[N, 3, 112, 112]`` in [-1, 1] (see :func:`normalize_images`)
    to ``[N, embedding_size]`` un-normalised embeddings. ``name`` is one of
    :func:`list_backbones` or ``timm:<model>`` (:mod:`partial_fc.backbones.timm_adapter`).
    ``checkpointing`` (iResNets, ViTs): 0 = off, k = activation checkpointing of every k-th
    block, exact (:mod:`partial_fc.backbones.checkpointing`). ``depth`` (ViTs): blocks instead
    of the architecture's (tests and CPU smoke runs); ``drop_path`` and ``mask_ratio`` (ViTs):
    the last block's stochastic-depth rate and the masked share of tokens instead of the
    architecture's (arcface_torch's plain ``vit_t|s|b`` use 0.1 and 0.1).

    Raises:
        ValueError: unknown ``name`` (the message lists the valid names), non-positive
            ``embedding_size``, ``dropout`` outside [0, 1), an option the backbone lacks.
    """
    vit_options = {"depth": depth, "drop_path": drop_path, "mask_ratio": mask_ratio}
    errors = backbone_errors(name, embedding_size, dropout, checkpointing=checkpointing,
                             **vit_options)
    if errors:
        raise ValueError("; ".join(errors))
    if name.startswith(TIMM_PREFIX):
        return build_timm(name, embedding_size=embedding_size, dropout=dropout)
    options = {"checkpointing": checkpointing} if name in CHECKPOINTING else {}
    options.update({k: v for k, v in vit_options.items() if v is not None})
    return _BACKBONES[name](embedding_size=embedding_size, dropout=dropout, **options)


def normalize_images(images: torch.Tensor, flips: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 ``[N, 3, H, W]`` in [0, 255] -> float32 in [-1, 1], i.e. ``(x/255 - 0.5)/0.5``,
    with the images where ``flips`` (bool ``[N]``) is set mirrored left-right first.

    Runs on whatever device ``images`` is on, so the loader can ship uint8 and the
    conversion happens on the accelerator, and so can the training flip (the loader's
    ``flip="deferred"``): on a GPU it costs nothing next to the step, where the loader's
    workers would spend a tenth of their CPU on it (docs/benchmarks.md, "Loader").
    """
    if images.dtype != torch.uint8:
        raise TypeError(f"normalize_images expects uint8 images, got dtype {images.dtype}")
    if flips is not None:  # uint8 wraps mod 256: x + (x' - x) * bit is exactly x' or x
        bits = flips.view(-1, 1, 1, 1).to(torch.uint8)
        images = images + (images.flip(-1) - images) * bits  # 10x torch.where's speed on CPU
    return images.float().div_(127.5).sub_(1.0)
