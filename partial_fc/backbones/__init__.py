"""Face-recognition backbones: iResNet 18/34/50/100/200, a tiny CPU iResNet, MobileFaceNet,
ViT-T/S/B/L/H, and any timm model (``timm:<model>``)."""

from partial_fc.backbones.registry import (
    backbone_errors,
    build_backbone,
    list_backbones,
    normalize_images,
)

__all__ = ["backbone_errors", "build_backbone", "list_backbones", "normalize_images"]
