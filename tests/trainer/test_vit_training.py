"""ViT training through the engine: activation checkpointing on and off give the same steps
under DDP and DeepSpeed bf16 (2 gloo ranks), AdamW's decay groups, a resumed ViT run.

A ViT's feature layer has BatchNorm (per-rank batch statistics), so a 2-rank step is not a
1-rank step on the same batch; the reference of each 2-rank run is the same run without
checkpointing, which must match it bit for bit.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from launch_helpers import (
    EMBEDDING,
    NUM_CLASSES,
    local_micro_batches,
    make_config,
    same_snapshots,
    snapshot,
)
from spawn import run_ranks

GLOBAL_BATCH = 4  # 2 images a rank: DeepSpeed bf16 runs bf16 matmuls, ~10x fp32 on an AVX2 CPU
STEPS = 3  # the third starts from a checkpoint of the second, too
SPECS = {  # name -> overrides; each run once without and once with checkpointing
    "ddp-fp32": ("engine.type=ddp", "engine.precision=fp32"),
    "deepspeed-bf16": ("engine.type=deepspeed", "engine.precision=bf16", "engine.zero_stage=1"),
}
VIT = ("optim.name=adamw", "optim.lr=0.001", "optim.weight_decay=0.1", "optim.decay=weights",
       "margin.type=cosface", "margin.m=0.35", "margin.warmup_steps=2", "backbone.name=vit_t",
       "backbone.depth=2")


def _engine(cfg):
    from partial_fc import PartialFC, build_margin
    from partial_fc.backbones import build_backbone
    from trainer.engine import Engine

    torch.manual_seed(0)
    backbone = build_backbone(**{**cfg.backbone.build_kwargs(), "embedding_size": EMBEDDING})
    head = PartialFC(EMBEDDING, NUM_CLASSES, build_margin(cfg.margin_kwargs()), seed=cfg.seed)
    from trainer.dist import attach

    return Engine(cfg, backbone, head, attach(torch.device("cpu")), total_steps=10,
                  warmup_steps=1)


def _runs(rank: int, world: int, root: str) -> dict:
    from trainer import checkpoint

    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed insists; torchrun sets it
    batches = [local_micro_batches(s, GLOBAL_BATCH, rank, world, 1) for s in range(STEPS)]
    out = {}
    for name, overrides in SPECS.items():
        for every in (0, 1):
            cfg = make_config(*VIT, *overrides, f"backbone.checkpointing={every}",
                              f"train.batch_size={GLOBAL_BATCH // world}")
            engine = _engine(cfg)
            losses = [engine.step(s, batches[s]).loss for s in range(STEPS - 1)]
            # Both save (a save averages the BatchNorm statistics over the ranks); the
            # checkpointed run's is resumed below (the plain run equals it).
            folder = checkpoint.save(Path(root) / f"{name}-{every}", STEPS - 1, engine,
                                     checkpoint.RunRecord(), 1)
            torch.manual_seed(7 + rank)  # the same stochastic-depth draws in all last steps
            losses.append(engine.step(STEPS - 1, batches[-1]).loss)
            out[(name, every)] = {"losses": losses, **snapshot(engine)}
            if every:
                resumed = _engine(cfg)  # a fresh engine from the checkpoint: the last step
                checkpoint.load(folder, resumed)
                torch.manual_seed(7 + rank)
                out[(name, every)] |= {"third": resumed.step(STEPS - 1, batches[-1]).loss,
                                       "resumed": snapshot(resumed)}
    return out


# long: 30 s on an AVX-512 BF16 Xeon, 98 s on CI's AVX2 EPYC (DeepSpeed's bf16 matmuls on
# torch's reference kernels); test_vit.py's test_checkpointing_is_exact holds the blocks to
# bit-identical outputs, gradients and statistics in make test.
@pytest.mark.slow
@pytest.mark.long
def test_checkpointing_steps_equal_plain_steps_and_resume(tmp_path):
    per_rank = run_ranks(_runs, 2, args=(str(tmp_path),), timeout=540)
    for rank, res in enumerate(per_rank):
        for name in SPECS:
            plain, ckpt = res[(name, 0)], res[(name, 1)]
            assert ckpt["losses"] == plain["losses"], (rank, name)
            assert same_snapshots(ckpt, plain), (rank, name)
            assert all(map(math.isfinite, plain["losses"])), (rank, name)
            # the resumed engine's last step is the original's
            assert ckpt["third"] == ckpt["losses"][-1], (rank, name)
            assert same_snapshots(ckpt["resumed"], ckpt), (rank, name)
        assert res[("ddp-fp32", 0)]["losses"] == per_rank[0][("ddp-fp32", 0)]["losses"]


def test_decay_groups_leave_norms_biases_and_position_embedding_alone():
    from partial_fc.backbones import build_backbone
    from trainer.config import OptimConfig
    from trainer.engine import decay_groups

    with torch.device("meta"):  # names and shapes only
        model = build_backbone("vit_b", 8, depth=1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed, plain = decay_groups(OptimConfig(name="adamw", decay="weights"), model)
    assert "weight_decay" not in decayed and plain["weight_decay"] == 0.0
    plain_names = {names[id(p)] for p in plain["params"]}
    assert {"pos_embed", "mask_token", "blocks.0.norm1.weight", "blocks.0.attn.proj.bias",
            "feature.1.weight", "patch_embed.bias"} <= plain_names
    assert {names[id(p)] for p in decayed["params"]} == {
        "patch_embed.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight",
        "blocks.0.mlp.0.weight", "blocks.0.mlp.2.weight", "feature.0.weight", "feature.2.weight"}
    (everything,) = decay_groups(OptimConfig(name="adamw"), model)
    assert len(everything["params"]) == len(list(model.parameters()))


def test_adamw_decay_skips_the_plain_group():
    """One AdamW step with zero gradients: the decayed weights shrink by lr * wd, the others
    stay (decoupled decay, arXiv 1711.05101 Alg. 2 line 12)."""
    from partial_fc.backbones import build_backbone
    from trainer.engine import make_optimizer

    cfg = make_config("optim.name=adamw", "optim.lr=0.1", "optim.weight_decay=0.5",
                      "optim.decay=weights")
    model = build_backbone("vit_t", 8, depth=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = make_optimizer(cfg.optim, model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = dict(model.named_parameters())
    torch.testing.assert_close(after["feature.0.weight"], before["feature.0.weight"] * 0.95)
    assert torch.equal(after["pos_embed"], before["pos_embed"])
    assert torch.equal(after["blocks.0.norm1.weight"], before["blocks.0.norm1.weight"])


def test_resume_accepts_checkpointing_and_refuses_another_depth():
    """Checkpointing changes memory and time, not the model: a note. Another depth is
    another model: refused in one line."""
    from trainer.config import ConfigError, resume_drift

    saved = make_config(*VIT).model_dump(mode="json")
    notes = resume_drift(saved, make_config(*VIT, "backbone.checkpointing=2"), "CKPT")
    assert notes == ["backbone.checkpointing 0 -> 2"]
    with pytest.raises(ConfigError, match="CKPT was trained as another model: backbone.depth "
                                          "2 -> 3"):
        resume_drift(saved, make_config(*VIT, "backbone.depth=3"), "CKPT")
