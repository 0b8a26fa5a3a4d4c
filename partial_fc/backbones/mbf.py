"""insightface arcface_torch's MobileFaceNet variants, ``mbf`` and ``mbf_large``.

Its recipes train a wider MobileFaceNet than the paper's (arXiv:1804.07573, Table 1; ours is
``mobilefacenet``): every width times ``scale`` (2, or 4 for ``mbf_large``), four stages of
``blocks`` inverted residuals (1-4-6-2, or 2-8-12-4), and expansion widths fixed at 128, 256
and 512 channels instead of a multiple of the input. Stem: 3x3 stride 2; then a 3x3 grouped
convolution (64 groups) or the first stage's residuals; a stride-2 bottleneck opens each later
stage; 1x1 to 512; the 7x7 depthwise GDConv; ``Linear(512, D)`` without bias + BN1d. Built from
``mobilefacenet``'s blocks, parameters in its modules' order, so an arcface_torch state_dict
maps onto it position by position (``offline.insightface``).
"""

from __future__ import annotations

from torch import nn

from partial_fc.backbones.mobilefacenet import Bottleneck, GDConvEmbedding, conv_bn


class WideMobileFaceNet(GDConvEmbedding):
    """Float ``[N, 3, 112, 112]`` in [-1, 1] -> ``[N, embedding_size]``."""

    def __init__(self, embedding_size: int = 512, dropout: float = 0.0,
                 blocks: tuple[int, int, int, int] = (1, 4, 6, 2), scale: int = 2) -> None:
        c1, c2 = 64 * scale, 128 * scale
        layers: list[nn.Module] = [conv_bn(3, c1, 3, 2, 1, act=True)]
        if blocks[0] == 1:
            layers.append(conv_bn(c1, c1, 3, 1, 64, act=True))
        else:
            layers += [Bottleneck(c1, c1, 1, 1, hidden=128) for _ in range(blocks[0])]
        # (cin, cout, hidden of the stride-2 opener, hidden of the stage, repeats)
        for cin, cout, opener, hidden, repeats in ((c1, c1, 128, 128, blocks[1]),
                                                   (c1, c2, 256, 256, blocks[2]),
                                                   (c2, c2, 512, 256, blocks[3])):
            layers.append(Bottleneck(cin, cout, 1, 2, hidden=opener))
            layers += [Bottleneck(cout, cout, 1, 1, hidden=hidden) for _ in range(repeats)]
        super().__init__(layers, c2, embedding_size, dropout, init_linear=True)


def mbf(embedding_size: int = 512, dropout: float = 0.0) -> WideMobileFaceNet:
    return WideMobileFaceNet(embedding_size, dropout)


def mbf_large(embedding_size: int = 512, dropout: float = 0.0) -> WideMobileFaceNet:
    return WideMobileFaceNet(embedding_size, dropout, blocks=(2, 8, 12, 4), scale=4)
