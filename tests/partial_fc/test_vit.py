"""ViT backbones and activation checkpointing: sizes, layout, attention, masking, exactness.

Every backbone's shape and backward is in test_backbones.py (parametrised over the registry).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from partial_fc.backbones import build_backbone
from partial_fc.backbones.vit import TOKENS, Attention, VisionTransformer

# (width, depth) of insightface's ViTs.
_SIZES = {"vit_t": (256, 12), "vit_s": (512, 12), "vit_b": (512, 24), "vit_l": (768, 24),
          "vit_h": (1024, 48)}


def _expected_params(width: int, depth: int, emb: int, masked: bool) -> int:
    """The architecture's parameter count, term by term (module docstring of vit.py)."""
    c = width
    block = 2 * 2 * c + 3 * c * c + (c * c + c) + (c * 4 * c + 4 * c) + (4 * c * c + c)
    patch = 3 * 9 * 9 * c + c
    tokens = TOKENS * c + (c if masked else 0)  # position embedding (+ mask token)
    head = 2 * c + TOKENS * c * c + 2 * c + c * emb + 2 * emb  # final LN, two Linear + BN1d
    return patch + tokens + depth * block + head


@pytest.mark.parametrize("name", sorted(_SIZES))
def test_parameter_counts(name):
    with torch.device("meta"):
        model = build_backbone(name, embedding_size=512)
    width, depth = _SIZES[name]
    assert len(model.blocks) == depth and model.width == width
    masked = model.mask_ratio > 0
    assert (model.mask_token is not None) == masked == (name in ("vit_b", "vit_l"))
    assert sum(p.numel() for p in model.parameters()) == _expected_params(width, depth, 512,
                                                                          masked)


def test_tokens_and_layout():
    """Patch 9 on 112x112: 144 tokens; pre-norm blocks; the embedding head's order."""
    model = build_backbone("vit_t", embedding_size=32, depth=2)
    assert TOKENS == 144 and model.pos_embed.shape == (1, 144, 256)
    assert model.patch_embed.kernel_size == (9, 9) and model.patch_embed.stride == (9, 9)
    assert [type(m).__name__ for m in model.feature] == [
        "Linear", "BatchNorm1d", "Linear", "BatchNorm1d"]
    assert model.feature[0].in_features == 144 * 256 and model.feature[0].bias is None
    assert model.blocks[0].attn.qkv.bias is None and model.blocks[0].attn.heads == 8
    assert len(model.blocks) == 2  # the depth override
    # The drop-path rates rise linearly to the architecture's 0.05 at the last block.
    assert [b.drop_path for b in model.blocks] == [0.0, 0.05]


def test_attention_matches_the_softmax_formula():
    """SDPA equals softmax(q k^T / sqrt(d)) v per head (arXiv 2010.11929, Eq. 5 of its
    appendix), in fp64."""
    torch.manual_seed(0)
    attn = Attention(16, heads=4).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    q, k, v = attn.qkv(x).view(2, 5, 3, 4, 4).permute(2, 0, 3, 1, 4)
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(4), dim=-1)
    want = attn.proj((weights @ v).transpose(1, 2).reshape(2, 5, 16))
    torch.testing.assert_close(attn(x), want)


def test_tokens_do_not_leak_across_the_batch():
    """Each image's embedding depends on that image alone (eval mode: BatchNorm's running
    statistics, no masking or stochastic depth)."""
    torch.manual_seed(0)
    model = build_backbone("vit_t", embedding_size=16, depth=2).eval()
    x = torch.rand(3, 3, 112, 112) * 2 - 1
    with torch.no_grad():
        together = model(x)
        alone = torch.cat([model(x[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_masking_keeps_the_unmasked_tokens_in_place():
    """Training-mode masking drops ``mask_ratio`` of the tokens before the blocks and puts
    the mask token in their places after the final LayerNorm; the others keep their order."""
    torch.manual_seed(0)
    model = VisionTransformer(8, 1, 4, mask_ratio=0.25).train()
    seen = {}
    model.norm.register_forward_hook(lambda m, i, out: seen.setdefault("normed", out))
    model.feature.register_forward_hook(lambda m, i, out: seen.setdefault("flat", i[0]))
    model(torch.rand(2, 3, 112, 112) * 2 - 1)
    kept = int(144 * 0.75)
    assert seen["normed"].shape == (2, kept, 8)
    flat = seen["flat"].view(2, 144, 8)
    is_mask = (flat == model.mask_token.detach()).all(-1)
    assert is_mask.sum(1).tolist() == [144 - kept] * 2
    for i in range(2):  # the kept tokens, in their original order
        assert torch.equal(flat[i][~is_mask[i]].sort(0).values,
                           seen["normed"][i].sort(0).values)


def _step(model: nn.Module, x: torch.Tensor, seed: int):
    torch.manual_seed(seed)  # the same dropout, drop-path and masking draws
    out = model(x)
    (out * torch.arange(out.shape[1], dtype=out.dtype)).square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.detach(), grads, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("name", ["vit_t", "iresnet_tiny"])
def test_checkpointing_is_exact(name, every):
    """Checkpointed blocks give bit-identical outputs, gradients and buffers: the RNG is
    replayed (masking, stochastic depth, dropout) and BatchNorm's running statistics are
    updated once, not again when a block is recomputed."""
    def build(checkpointing: int) -> nn.Module:
        torch.manual_seed(0)
        if name == "vit_t":  # narrow, with every random part on
            return VisionTransformer(64, 3, 16, drop_path=0.2, mask_ratio=0.3, dropout=0.1,
                                     checkpointing=checkpointing).train()
        return build_backbone(name, 16, dropout=0.1, checkpointing=checkpointing).train()

    plain, ckpt = build(0), build(every)
    recomputed = []
    for m in ckpt.modules():  # the recomputation must really happen
        if type(m).__name__ in ("Block", "IBasicBlock"):
            m.register_forward_pre_hook(lambda *_: recomputed.append(1))
    x = torch.rand(4, 3, 112, 112) * 2 - 1
    out_a, grads_a, state_a = _step(plain, x, seed=5)
    out_b, grads_b, state_b = _step(ckpt, x, seed=5)
    blocks = 3 if name == "vit_t" else 4
    assert len(recomputed) == blocks + len(range(0, blocks, every))
    assert torch.equal(out_a, out_b)
    assert grads_a.keys() == grads_b.keys()
    for key in grads_a:
        assert torch.equal(grads_a[key], grads_b[key]), key
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key


def test_checkpointing_is_off_without_gradients():
    """Evaluation (no_grad) runs the blocks once."""
    model = build_backbone("vit_t", 8, depth=2, checkpointing=1).eval()
    calls = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        model(torch.rand(1, 3, 112, 112))
    assert len(calls) == 2


@pytest.mark.half
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_parameters_cast_to_low_precision(dtype):
    """DeepSpeed's bf16/fp16 modes: parameters cast, BatchNorm statistics fp32, a train step
    runs; the output is close to what autocast computes from the fp32 model (compared in
    eval mode: BatchNorm over a batch of random images at initialisation divides by a tiny
    spread and would amplify any rounding)."""
    torch.manual_seed(0)
    ref = build_backbone("vit_t", 24, depth=2)
    low = build_backbone("vit_t", 24, depth=2)
    low.load_state_dict(ref.state_dict())
    for p in low.parameters():
        p.data = p.data.to(dtype)
    x = torch.rand(4, 3, 112, 112) * 2 - 1
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        expected = ref.eval()(x).float()
    with torch.no_grad():
        got = low.eval()(x.to(dtype)).float()
    # the cast model rounds to dtype where autocast keeps fp32 (LayerNorm, softmax, GELU's
    # outputs): four roundings of u = eps / 2 (measured: 1.2-1.6 u under each ISA of make
    # test-isa, bf16 and fp16 alike; the fixed 2e-2 this replaced was 41 u of fp16)
    err = float((got - expected).norm() / expected.norm())
    assert err < 2 * torch.finfo(dtype).eps, f"{dtype}: relative difference to autocast {err:.3g}"
    out = low.train()(x.to(dtype))
    out.float().square().sum().backward()
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert low.feature[1].running_mean.dtype == torch.float32
    assert all(p.grad is not None and p.grad.dtype == dtype for p in low.parameters())


def test_no_weight_decay_names_exist():
    with torch.device("meta"):  # names only
        model = build_backbone("vit_b", 8, depth=1)
    names = dict(model.named_parameters())
    assert model.no_weight_decay() == {"pos_embed", "mask_token"}
    assert model.no_weight_decay() <= names.keys()


@pytest.mark.slow
@pytest.mark.long  # torch.compile's step is make test's in test_engine.py (25 CPU-s here)
def test_checkpointing_under_torch_compile():
    """``engine.compile``: the compiler recomputes checkpointed regions in its own backward
    graph, where BatchNorm's running statistics update once (iresnet_tiny: bit-identical
    outputs, gradients and statistics here; a ViT differs by inductor's fp32 fusion order
    only, about 1e-6 relative)."""

    def step(every: int):
        torch.manual_seed(0)
        model = build_backbone("iresnet_tiny", 8, checkpointing=every).train()
        # inductor's own graph passes (decompositions, the min-cut partitioner that decides what
        # the backward recomputes) without its C++ code generation, which test_engine's compiled
        # step covers: the checkpointed regions' recompute is decided before code generation
        compiled = torch.compile(model, backend="aot_eager_decomp_partition")
        out = compiled(torch.rand(4, 3, 112, 112) * 2 - 1)
        out.square().sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        return out.detach(), grads, model.state_dict()

    (out_a, grads_a, state_a), (out_b, grads_b, state_b) = step(0), step(1)
    assert torch.equal(out_a, out_b)
    for key in grads_a:
        assert torch.equal(grads_a[key], grads_b[key]), key
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key
