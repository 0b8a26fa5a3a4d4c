"""Vision Transformer face backbones: ViT-T/S/B/L/H as insightface trains them on WebFace42M.

The ViT of Dosovitskiy et al., "An Image is Worth 16x16 Words" (arXiv 2010.11929, Sec. 3.1,
Eq. 1-4), in the face-recognition form insightface's ``arcface_torch`` uses with Partial FC
(An et al., arXiv 2203.15565, its WebFace42M ViT results):

* patch embedding: a 9x9 convolution of stride 9 on the 112x112 crop, 12 x 12 = 144 tokens
  (the last 4 rows and columns of pixels fall outside every patch), plus a learned position
  embedding; no class token;
* ``depth`` pre-norm blocks (Eq. 2-3): ``x + MSA(LN(x))`` then ``x + MLP(LN(x))``, 8 heads,
  no bias on the query/key/value projection, MLP ratio 4 with ReLU6; stochastic depth
  (Huang et al., arXiv 1603.09382) rising linearly over the blocks to ``drop_path``;
* training-time token masking (``mask_ratio``): a random share of each image's tokens skips
  the blocks and re-enters after the final LayerNorm as one learned mask token (insightface's
  regulariser for its larger ViTs);
* embedding head: final LayerNorm, the 144 tokens flattened, ``Linear(144*C -> C)`` + BN1d,
  ``Linear(C -> D)`` + BN1d (both without bias, BN eps 2e-5), insightface's feature layer.

Attention is ``F.scaled_dot_product_attention``: on CUDA its flash / memory-efficient kernels
(no ``[tokens, tokens]`` matrix kept for the backward). Under bf16 autocast q, k and v are
bf16 and those kernels, like the CPU flash kernel, keep the score maximum, the exponentials'
sums and the output accumulator in fp32 (insightface runs this part in fp32 by leaving
autocast), so the softmax is not computed in bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from partial_fc.backbones.checkpointing import run_blocks
from partial_fc.backbones.norm import BatchNorm1d

IMAGE, PATCH = 112, 9
TOKENS = (IMAGE // PATCH) ** 2  # 144
HEADS, MLP_RATIO = 8, 4


class Attention(nn.Module):
    """Multi-head self-attention ``[N, L, C] -> [N, L, C]`` (arXiv 2010.11929, Eq. 2)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, dim = x.shape
        q, k, v = self.qkv(x).view(n, length, 3, self.heads, dim // self.heads).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2))  # [N, heads, L, C/heads]
        return self.proj(out.transpose(1, 2).reshape(n, length, dim))


def _drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth: the whole residual branch of a sample is dropped with probability
    ``p`` and the kept ones are scaled by ``1 / (1 - p)`` (arXiv 1603.09382, Eq. 2-5)."""
    if p == 0.0 or not training:
        return x
    keep = torch.empty(x.shape[0], *(1,) * (x.ndim - 1), dtype=x.dtype, device=x.device)
    return x * keep.bernoulli_(1.0 - p).div_(1.0 - p)


class Block(nn.Module):
    """Pre-norm transformer block ``[N, L, C] -> [N, L, C]`` (arXiv 2010.11929, Eq. 2-3)."""

    def __init__(self, dim: int, heads: int, drop_path: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, MLP_RATIO * dim), nn.ReLU6(),
                                 nn.Linear(MLP_RATIO * dim, dim))
        self.drop_path = drop_path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + _drop_path(self.attn(self.norm1(x)), self.drop_path, self.training)
        return x + _drop_path(self.mlp(self.norm2(x)), self.drop_path, self.training)


class VisionTransformer(nn.Module):
    """ViT mapping float ``[N, 3, 112, 112]`` in [-1, 1] to ``[N, embedding_size]``.

    Args:
        width: token width C. depth: blocks. embedding_size: output dimension D.
        drop_path: stochastic-depth rate of the last block (linear from 0 at the first).
        mask_ratio: share of tokens masked in training mode (0 disables; the mask token
            exists only when it is positive).
        dropout: drop probability on the flattened tokens before the feature layer.
        checkpointing: 0 = off, k = activation checkpointing of every k-th block
            (:func:`partial_fc.backbones.checkpointing.run_blocks`; training only).
    """

    def __init__(self, width: int, depth: int, embedding_size: int = 512, *,
                 drop_path: float = 0.0, mask_ratio: float = 0.0, dropout: float = 0.0,
                 checkpointing: int = 0) -> None:
        super().__init__()
        self.width, self.mask_ratio, self.checkpointing = width, mask_ratio, checkpointing
        self.patch_embed = nn.Conv2d(3, width, PATCH, stride=PATCH)
        self.pos_embed = nn.Parameter(torch.zeros(1, TOKENS, width))
        # Only where masking is on: a parameter without gradient would stop DDP.
        self.mask_token = nn.Parameter(torch.zeros(1, 1, width)) if mask_ratio > 0 else None
        rates = [drop_path * i / max(1, depth - 1) for i in range(depth)]
        self.blocks = nn.ModuleList(Block(width, HEADS, r) for r in rates)
        self.norm = nn.LayerNorm(width)
        self.dropout = nn.Dropout(dropout)
        self.feature = nn.Sequential(
            nn.Linear(TOKENS * width, width, bias=False), BatchNorm1d(width, eps=2e-5),
            nn.Linear(width, embedding_size, bias=False), BatchNorm1d(embedding_size, eps=2e-5),
        )
        self._init_weights()

    def _init_weights(self) -> None:
        """Linear weights and the position embedding truncated N(0, 0.02), biases 0, the
        mask token N(0, 0.02) (the ViT / insightface initialisation)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02, a=-0.04, b=0.04)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        nn.init.trunc_normal_(self.pos_embed, std=0.02, a=-0.04, b=0.04)
        if self.mask_token is not None:
            nn.init.normal_(self.mask_token, std=0.02)

    def no_weight_decay(self) -> set[str]:
        """Parameters that take no weight decay besides norms and biases (timm's convention,
        which the trainer's ``optim.decay=weights`` reads)."""
        return {"pos_embed", "mask_token"} if self.mask_token is not None else {"pos_embed"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed  # [N, 144, C]
        restore = None
        if self.training and self.mask_ratio > 0:
            x, restore = self._mask(x)
        x = run_blocks(self.blocks, x, self.checkpointing)
        x = self.norm(x)
        if restore is not None:
            fill = self.mask_token.to(x.dtype).expand(n, TOKENS - x.shape[1], -1)
            x = torch.cat([x, fill], 1).gather(1, restore.unsqueeze(-1).expand(-1, -1, self.width))
        return self.feature(self.dropout(x.reshape(n, TOKENS * self.width)))

    def _mask(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep a random ``1 - mask_ratio`` of each sample's tokens: ``([N, kept, C], the
        permutation's inverse [N, 144])``, the order :meth:`forward` puts them back in."""
        kept = int(TOKENS * (1 - self.mask_ratio))
        order = torch.rand(x.shape[0], TOKENS, device=x.device).argsort(1)
        keep = order[:, :kept].unsqueeze(-1).expand(-1, -1, self.width)
        return x.gather(1, keep), order.argsort(1)


def _vit(width: int, depth: int, drop_path: float, mask_ratio: float):
    def build(embedding_size: int = 512, dropout: float = 0.0, *, checkpointing: int = 0,
              depth: int = depth, drop_path: float = drop_path,
              mask_ratio: float = mask_ratio) -> VisionTransformer:
        return VisionTransformer(width, depth, embedding_size, drop_path=drop_path,
                                 mask_ratio=mask_ratio, dropout=dropout,
                                 checkpointing=checkpointing)

    return build


# Widths and depths of insightface's ViTs; drop_path and mask_ratio of its WebFace42M
# variants (vit_t_dp005_mask0, vit_s_dp005_mask_0, vit_b/l_dp005_mask_005, vit_h).
vit_t = _vit(256, 12, drop_path=0.05, mask_ratio=0.0)
vit_s = _vit(512, 12, drop_path=0.05, mask_ratio=0.0)
vit_b = _vit(512, 24, drop_path=0.05, mask_ratio=0.05)
vit_l = _vit(768, 24, drop_path=0.05, mask_ratio=0.05)
vit_h = _vit(1024, 48, drop_path=0.1, mask_ratio=0.0)
