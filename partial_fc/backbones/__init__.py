"""Face-recognition backbones: iResNet 18/34/50/100/200, a tiny CPU iResNet, MobileFaceNet."""

from partial_fc.backbones.registry import build_backbone, list_backbones, normalize_images

__all__ = ["build_backbone", "list_backbones", "normalize_images"]
