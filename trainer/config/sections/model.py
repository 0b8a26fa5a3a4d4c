"""The ``backbone:`` and ``head:`` sections: the embedding network and the class-sharded
classifier (Partial FC) on top of it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import torch
from pydantic import Field

from partial_fc.head_checks import SAMPLE_RATE
from partial_fc.tiles import KERNELS
from trainer.config.sections.base import NonNegInt, PosFloat, PosInt, Section, UnitFloat, bounded


class BackboneConfig(Section):
    name: str = Field(
        "iresnet50", description="backbone architecture (partial_fc.backbones.list_backbones():"
        " iresnet*, mobilefacenet, mbf, mbf_large, vit_t|s|b|l|h), or timm:<model> for a timm "
        "model (pip install 'partial-fc[timm]')"
    )
    embedding_size: PosInt = Field(512, description="length of the face embedding")
    dropout: UnitFloat = Field(0.0, description="dropout before the embedding layer, in [0, 1)")
    checkpointing: NonNegInt = Field(0, description="activation checkpointing (iresnet*, "
                                     "vit_*): 0 = off, k = every k-th block recomputed in the "
                                     "backward; exact (docs/vit.md)")
    depth: PosInt | None = Field(None, description="vit_* only: transformer blocks instead "
                                 "of the architecture's (small CPU runs); null = its own")
    drop_path: Annotated[float, Field(ge=0, lt=1)] | None = Field(
        None, description="vit_* only: the last block's stochastic-depth rate; null = the "
        "architecture's own (arcface_torch's plain vit_t|s|b: 0.1)")
    mask_ratio: Annotated[float, Field(ge=0, lt=1)] | None = Field(
        None, description="vit_* only: the share of tokens masked in training; null = the "
        "architecture's own (arcface_torch's plain vit_t|s|b: 0.1)")
    weights: str | None = Field(None, description="a local state_dict to start from (the "
                                "backbone's; for timm:<model> the timm model's); null = random")

    def build_kwargs(self) -> dict[str, Any]:
        """``partial_fc.backbones.build_backbone``'s arguments this section sets."""
        return {"name": self.name, "embedding_size": self.embedding_size,
                "dropout": self.dropout, "checkpointing": self.checkpointing,
                "depth": self.depth, "drop_path": self.drop_path, "mask_ratio": self.mask_ratio}


class HeadConfig(Section):
    sample_rate: bounded(float, SAMPLE_RATE) = Field(  # type: ignore[valid-type]
        1.0, description="share of the classes (the batch's own always included) each step's "
        "softmax is computed over (Partial FC); 1 = all, 0 = the batch's own only"
    )
    kernel: Literal[KERNELS] = Field(
        "auto", description="class-tile passes of the head: triton (CUDA kernels), torch "
        "(PyTorch, chunked over classes), auto = triton on CUDA when installed, else torch; the "
        "first step checks the kernels against torch on a slice: auto goes on with torch after "
        "a mismatch (one line says so), triton stops the run"
    )
    max_tile_mib: PosInt = Field(
        32, description="torch kernel: MiB of fp32 [batch, classes] cosines per class chunk "
        "(memory budget; no [batch, num_local] buffer is ever allocated)"
    )
    # Its own budget, not max_tile_mib: it bounds other tensors ([rows, D] copies, whatever the
    # batch), on every kernel, and trades memory against kernel launches per step.
    max_update_mib: PosInt = Field(
        64, description="head optimizer: MiB of fp32 temporaries per chunk of updated rows "
        "(bounds the step's working memory whatever the number of sampled rows)"
    )
    state_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="dtype of the head's weight, gradient and optimizer state; bf16 "
        "halves them (bf16 matmul operands, fp32 accumulation, softmax and update arithmetic)"
    )
    update: Literal["sampled", "dense"] = Field(
        "sampled", description="head optimizer at sample_rate < 1: sampled = only the rows "
        "of the step's sample move; dense = every row, unsampled ones by momentum and weight "
        "decay (insightface arcface_torch's single SGD over the shard)"
    )
    init: Literal["per_class", "per_rank"] = Field(
        "per_class", description="initial rows: per_class = a function of (seed, class), "
        "the same on any number of ranks; per_rank = every rank starts from rank 0's rows "
        "(arcface_torch: one seed, the same draw on every rank)"
    )
    loss_cap: PosFloat | None = Field(
        None, description="report each sample's loss as at most this (arcface_torch: "
        "-ln 1e-30 = 69.08); the gradient is not changed, as there; null = no cap"
    )
    grad_filter: bool = Field(
        False, description="triton kernel: skip the backward's class tiles whose gradient "
        "sits below the bf16 rounding it already gets (bounded; docs/kernels.md); off = exact, "
        "until a GPU run shows an unchanged training curve; torch path and non-target "
        "transforms stay exact"
    )

    def partial_fc_kwargs(self) -> dict[str, Any]:
        """``PartialFC``'s keyword arguments this section sets (bytes, a torch dtype)."""
        return {"sample_rate": self.sample_rate, "kernel": self.kernel,
                "init": self.init, "loss_cap": self.loss_cap, "grad_filter": self.grad_filter,
                "max_tile_bytes": self.max_tile_mib << 20,
                "state_dtype": {"fp32": torch.float32, "bf16": torch.bfloat16}[self.state_dtype]}
