"""iResNet face backbones (insightface "arcface_torch" variants).

The improved ResNet of Duta et al., "Improved Residual Networks for Image and
Video Recognition" (arXiv 2004.04989), as adapted for 112x112 faces by Deng et
al., "ArcFace" (arXiv 1801.07698, Sec. 3.2 / Table 2, "E" output setting):

* stem: conv3x3 stride 1 + BN + PReLU (no max-pool: 112x112 faces are small);
* ``IBasicBlock``: BN - conv3x3 - BN - PReLU - conv3x3(stride) - BN, plus the
  identity (or a conv1x1 + BN projection when stride or width changes);
* four stages at stride 2 each: 112 -> 56 -> 28 -> 14 -> 7;
* head ("option E"): BN2d - dropout - flatten - FC(C*7*7 -> D) - BN1d.

As in insightface, the final BN1d's scale is frozen at 1 (``requires_grad=False``);
only its shift and running statistics learn. Parameter names follow insightface's,
so its ``backbone.pth`` state_dicts load here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from partial_fc.backbones.checkpointing import run_blocks
from partial_fc.backbones.norm import BatchNorm1d, BatchNorm2d

_FEATURE_MAP = 7  # 112 / 2**4


class IBasicBlock(nn.Module):
    """Pre-activation-style basic block; ``stride`` sits on the second conv.

    Shapes: ``[N, inplanes, H, W] -> [N, planes, H/stride, W/stride]``.
    """

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.bn1 = BatchNorm2d(inplanes, eps=1e-5)
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = BatchNorm2d(planes, eps=1e-5)
        self.prelu = nn.PReLU(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn3 = BatchNorm2d(planes, eps=1e-5)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False),
                BatchNorm2d(planes, eps=1e-5),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        identity = x if self.downsample is None else self.downsample(x)
        return out + identity


class IResNet(nn.Module):
    """iResNet mapping float ``[N, 3, 112, 112]`` in [-1, 1] to ``[N, embedding_size]``.

    Args:
        layers: blocks per stage, e.g. ``(3, 4, 14, 3)`` for iResNet-50.
        widths: channels per stage; the stem has ``widths[0]`` channels.
        embedding_size: output dimension D.
        dropout: drop probability on the flattened 7x7 feature map (0 disables).
        checkpointing: 0 = off, k = activation checkpointing of every k-th block of the
            four stages counted together (:func:`partial_fc.backbones.checkpointing.run_blocks`).
    """

    def __init__(
        self,
        layers: Sequence[int],
        widths: Sequence[int] = (64, 128, 256, 512),
        embedding_size: int = 512,
        dropout: float = 0.0,
        checkpointing: int = 0,
    ) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        assert len(layers) == len(widths) == 4, (layers, widths)
        self.conv1 = nn.Conv2d(3, widths[0], 3, stride=1, padding=1, bias=False)
        self.bn1 = BatchNorm2d(widths[0], eps=1e-5)
        self.prelu = nn.PReLU(widths[0])
        inplanes = widths[0]
        stages = []
        for planes, blocks in zip(widths, layers, strict=True):
            stage = [IBasicBlock(inplanes, planes, stride=2)]
            stage += [IBasicBlock(planes, planes) for _ in range(1, blocks)]
            stages.append(nn.Sequential(*stage))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.bn2 = BatchNorm2d(inplanes, eps=1e-5)
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(inplanes * _FEATURE_MAP * _FEATURE_MAP, embedding_size)
        self.features = BatchNorm1d(embedding_size, eps=1e-5)
        self._init_weights()

    def _init_weights(self) -> None:
        """insightface init: conv N(0, 0.1), BN scale 1 / shift 0, frozen BN1d scale."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, 0.0, 0.1)
            elif isinstance(m, nn.BatchNorm2d | nn.BatchNorm1d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        self.features.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.prelu(self.bn1(self.conv1(x)))
        blocks = [*self.layer1, *self.layer2, *self.layer3, *self.layer4]
        x = run_blocks(blocks, x, self.checkpointing)
        x = self.dropout(self.bn2(x))
        x = self.fc(torch.flatten(x, 1))
        return self.features(x)


def _iresnet(layers: Sequence[int], widths: Sequence[int] = (64, 128, 256, 512)):
    def build(embedding_size: int = 512, dropout: float = 0.0, *,
              checkpointing: int = 0) -> IResNet:
        return IResNet(layers, widths, embedding_size=embedding_size, dropout=dropout,
                       checkpointing=checkpointing)

    return build


iresnet18 = _iresnet((2, 2, 2, 2))
iresnet34 = _iresnet((3, 4, 6, 3))
iresnet50 = _iresnet((3, 4, 14, 3))
iresnet100 = _iresnet((3, 13, 30, 3))
iresnet200 = _iresnet((6, 26, 60, 6))
# Smoke runs and tests on CPU: one block per stage, 1/8 of the widths (its step time against
# the 1/4 widths: docs/benchmarks.md, "Training step").
iresnet_tiny = _iresnet((1, 1, 1, 1), widths=(8, 16, 32, 64))
