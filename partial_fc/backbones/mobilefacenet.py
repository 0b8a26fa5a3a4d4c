"""MobileFaceNet (Chen et al., arXiv 1804.07573, Table 1).

Layout of the paper's Table 1 for 112x112 input (t = expansion, c = channels,
n = repeats, s = stride):

=============  ===  ===  ===  ===
operator        t    c    n    s
=============  ===  ===  ===  ===
conv3x3         -    64   1    2
dw conv3x3      -    64   1    1
bottleneck      2    64   5    2
bottleneck      4   128   1    2
bottleneck      2   128   6    1
bottleneck      4   128   1    2
bottleneck      2   128   2    1
conv1x1         -   512   1    1
linear GDConv   -   512   1    1   (7x7 depthwise, no activation)
linear          -    D    1    1
=============  ===  ===  ===  ===

Deviations: the final linear layer is ``nn.Linear`` + BN1d (insightface's
variant, same maths as a 1x1 conv on a 1x1 map) and D defaults to 512 rather
than the paper's 128; ``dropout`` acts on the GDConv output before it.
"""

from __future__ import annotations

import torch
from torch import nn

from partial_fc.backbones.norm import BatchNorm1d, BatchNorm2d


def conv_bn(cin: int, cout: int, kernel: int, stride: int, groups: int, act: bool):
    """Conv (3x3 padded, other kernels unpadded) + BN (+ PReLU when ``act``)."""
    layers: list[nn.Module] = [
        nn.Conv2d(cin, cout, kernel, stride, padding=1 if kernel == 3 else 0,
                  groups=groups, bias=False),
        BatchNorm2d(cout),
    ]
    if act:
        layers.append(nn.PReLU(cout))
    return nn.Sequential(*layers)


class Bottleneck(nn.Module):
    """Inverted residual: 1x1 expand + PReLU, 3x3 depthwise + PReLU, linear 1x1 project.

    The residual connection is used when ``stride == 1`` and ``cin == cout``. ``hidden``
    (default ``cin * expansion``): the expanded width, given directly where a variant fixes it.
    """

    def __init__(self, cin: int, cout: int, expansion: int, stride: int,
                 hidden: int | None = None) -> None:
        super().__init__()
        hidden = cin * expansion if hidden is None else hidden
        self.residual = stride == 1 and cin == cout
        self.layers = nn.Sequential(
            conv_bn(cin, hidden, 1, 1, 1, act=True),
            conv_bn(hidden, hidden, 3, stride, hidden, act=True),
            conv_bn(hidden, cout, 1, 1, 1, act=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(x)
        return x + out if self.residual else out


# (expansion, channels, repeats, stride) for the bottleneck rows of Table 1.
_BOTTLENECKS = ((2, 64, 5, 2), (4, 128, 1, 2), (2, 128, 6, 1), (4, 128, 1, 2), (2, 128, 2, 1))


class GDConvEmbedding(nn.Module):
    """``stages`` (ending in ``channels`` at 7x7) + 1x1 conv to 512 + PReLU, the 7x7 depthwise
    linear GDConv, dropout, ``Linear(512 -> embedding_size)`` without bias + BN1d: the
    MobileFaceNet family's tail. Convolutions (and ``Linear`` with ``init_linear``) start from
    Kaiming normal, fan-out."""

    def __init__(self, stages: list[nn.Module], channels: int, embedding_size: int,
                 dropout: float, init_linear: bool = False) -> None:
        super().__init__()
        layers = [*stages, conv_bn(channels, 512, 1, 1, 1, act=True),
                  conv_bn(512, 512, 7, 1, 512, act=False)]  # GDConv: 7x7 -> 1x1
        self.body = nn.Sequential(*layers)
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(512, embedding_size, bias=False)
        self.features = BatchNorm1d(embedding_size)
        kinds = (nn.Conv2d, nn.Linear) if init_linear else (nn.Conv2d,)
        for m in self.modules():
            if isinstance(m, kinds):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(torch.flatten(self.body(x), 1))
        return self.features(self.fc(x))


class MobileFaceNet(GDConvEmbedding):
    """MobileFaceNet mapping float ``[N, 3, 112, 112]`` in [-1, 1] to ``[N, embedding_size]``."""

    def __init__(self, embedding_size: int = 512, dropout: float = 0.0) -> None:
        layers: list[nn.Module] = [
            conv_bn(3, 64, 3, 2, 1, act=True),
            conv_bn(64, 64, 3, 1, 64, act=True),
        ]
        cin = 64
        for expansion, cout, repeats, stride in _BOTTLENECKS:
            for i in range(repeats):
                layers.append(Bottleneck(cin, cout, expansion, stride if i == 0 else 1))
                cin = cout
        super().__init__(layers, cin, embedding_size, dropout)


def mobilefacenet(embedding_size: int = 512, dropout: float = 0.0) -> MobileFaceNet:
    return MobileFaceNet(embedding_size=embedding_size, dropout=dropout)
