"""Every registered backbone: output shape, gradients, parameter counts, registry errors."""

from __future__ import annotations

import pytest
import torch
from tolerances import rounding_excess

from partial_fc.backbones import build_backbone, list_backbones, normalize_images

# The full-width iResNets deeper than 18 are only run forward without autograd (a
# backward costs seconds): they are built from the same blocks as iresnet18 and
# iresnet_tiny, whose backward reaches every parameter; their layout is pinned by the
# parameter counts and the layer-order test below.
_FORWARD_ONLY = {"iresnet34", "iresnet50", "iresnet100", "iresnet200"}
# The ViTs wider than vit_s run with one block (their blocks are vit_t's at another width;
# tests/partial_fc/test_vit.py counts the parameters of every full-depth ViT).
_ONE_BLOCK = {"vit_b", "vit_l", "vit_h"}
# vit_l and vit_h differ from vit_b only in width, and their feature layer (144 tokens x width
# -> width: 151 M / 236 M parameters) costs 8-22 s to initialise and run on this CPU: their
# shapes are checked on the meta device; vit_t/s/b run the same code for real.
_SHAPE_ONLY = {"vit_l", "vit_h"}

# Parameter counts with a 512-d embedding. iresnet50/100 are the figures published
# for insightface's arcface_torch r50/r100 (43.59 M / 65.16 M).
_PARAMS = {
    "iresnet18": 24_025_600,
    "iresnet34": 34_139_328,
    "iresnet50": 43_590_848,
    "iresnet100": 65_156_160,
    "iresnet200": 118_833_920,
}


def test_registry_lists_the_contract_names():
    assert {
        "iresnet18", "iresnet34", "iresnet50", "iresnet100", "iresnet200",
        "mobilefacenet", "iresnet_tiny", "vit_t", "vit_s", "vit_b", "vit_l", "vit_h",
    } <= set(list_backbones())


@pytest.mark.parametrize(
    "name",
    # iresnet200's forward costs ~1.6 s (more on a loaded machine); its size is checked below.
    [pytest.param(n, marks=pytest.mark.slow) if n == "iresnet200" else n
     for n in list_backbones()],
)
def test_shape_and_backward(name):
    torch.manual_seed(0)
    depth = {"depth": 1} if name in _ONE_BLOCK else {}
    if name in _SHAPE_ONLY:
        with torch.device("meta"):
            out = build_backbone(name, embedding_size=24, dropout=0.1, **depth).train()(
                torch.empty(2, 3, 112, 112))
        assert out.shape == (2, 24)
        return
    model = build_backbone(name, embedding_size=24, dropout=0.1, **depth)
    if name in _FORWARD_ONLY:
        with torch.no_grad():  # train-mode BN: untrained eval-mode stats overflow at depth 200
            out = model.train()(torch.rand(2, 3, 112, 112) * 2 - 1)
        assert out.shape == (2, 24) and torch.isfinite(out).all()
        return
    x = (torch.rand(2, 3, 112, 112) * 2 - 1).requires_grad_()
    out = model.train()(x)
    assert out.shape == (2, 24) and torch.isfinite(out).all()
    out.square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trainable)


@pytest.mark.parametrize("name", sorted(_PARAMS))
def test_iresnet_parameter_counts(name):
    with torch.device("meta"):  # shapes only: no memory, no init cost
        model = build_backbone(name)
    assert sum(p.numel() for p in model.parameters()) == _PARAMS[name]


def test_mobilefacenet_matches_paper_size():
    # Chen et al. 2018, Table 1 / Sec. 4: 0.99 M parameters with a 128-d embedding.
    n = sum(p.numel() for p in build_backbone("mobilefacenet", embedding_size=128).parameters())
    assert 0.95e6 < n < 1.05e6


def test_embedding_size_and_eval_determinism():
    model = build_backbone("iresnet_tiny", embedding_size=7, dropout=0.5).eval()
    x = torch.rand(3, 3, 112, 112) * 2 - 1
    with torch.no_grad():
        assert torch.equal(model(x), model(x))  # dropout off in eval mode
    assert model(x).shape == (3, 7)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "resnet9000"}, "unknown backbone 'resnet9000'; choose one of .*iresnet50.*"
                                 "timm:<model>"),
        ({"name": "iresnet18", "embedding_size": 0}, "embedding_size"),
        ({"name": "iresnet18", "dropout": 1.0}, "dropout"),
        ({"name": "mobilefacenet", "checkpointing": 1}, "'mobilefacenet' has no checkpointed"),
        ({"name": "vit_t", "checkpointing": -1}, "checkpointing must be an int >= 0"),
        ({"name": "iresnet18", "depth": 2}, "depth=2: a positive block count for vit_"),
        ({"name": "vit_t", "depth": 0}, "depth=0"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_backbone(**kwargs)


def test_normalize_images():
    images = torch.tensor([0, 127, 255], dtype=torch.uint8).view(1, 3, 1, 1)
    out = normalize_images(images)
    assert out.dtype == torch.float32
    expected = (images.float() / 255 - 0.5) / 0.5
    torch.testing.assert_close(out, expected)
    assert out[0, 0, 0, 0] == -1.0 and out[0, 2, 0, 0] == 1.0
    with pytest.raises(TypeError, match="uint8"):
        normalize_images(images.float())


def test_normalize_images_mirrors_the_flipped_rows_in_their_layout():
    images = torch.randint(0, 256, (4, 5, 7, 3), dtype=torch.uint8).permute(0, 3, 1, 2)
    flips = torch.tensor([True, False, False, True])
    out = normalize_images(images, flips)
    for i, flip in enumerate(flips.tolist()):
        row = images[i:i + 1].flip(-1) if flip else images[i:i + 1]
        assert torch.equal(out[i:i + 1], normalize_images(row))
    assert out.is_contiguous(memory_format=torch.channels_last)  # as the loader ships them



def test_iresnet_layer_order():
    """ArcFace's iResNet: blocks BN-conv-BN-PReLU-conv-BN (+ conv-BN projection), output
    BN-dropout-FC-BN ("option E"), stride 2 on each stage's first block's second conv."""
    from partial_fc.backbones.iresnet import IResNet

    # Narrow, with two blocks in stage 2 so both block kinds occur; one forward.
    model = IResNet((1, 2, 1, 1), widths=(8, 16, 32, 64), embedding_size=8, dropout=0.2)
    order: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        if not list(module.children()):
            module.register_forward_hook(
                lambda m, *_, n=name: order.append((n, type(m).__name__)))
    with torch.no_grad():
        model.train()(torch.rand(2, 3, 112, 112) * 2 - 1)

    def inside(prefix: str) -> list[str]:
        return [kind for n, kind in order if n.startswith(prefix)]

    assert inside("layer2.0.") == ["BatchNorm2d", "Conv2d", "BatchNorm2d", "PReLU", "Conv2d",
                                   "BatchNorm2d", "Conv2d", "BatchNorm2d"]  # + projection
    assert [n for n, _ in order if n.startswith("layer2.1.")] == [
        "layer2.1.bn1", "layer2.1.conv1", "layer2.1.bn2", "layer2.1.prelu", "layer2.1.conv2",
        "layer2.1.bn3"]  # identity block: no projection
    first = model.layer2[0]
    assert first.conv1.stride == (1, 1) and first.conv2.stride == (2, 2)
    names = [n for n, _ in order]
    assert names[:3] == ["conv1", "bn1", "prelu"]  # stem, no max-pool
    assert names[-4:] == ["bn2", "dropout", "fc", "features"]
    assert order[-1][1] == "BatchNorm1d" and not model.features.weight.requires_grad
    assert model.fc.in_features == 64 * 7 * 7 and model.dropout.p == 0.2



# iresnet18 in bf16 only: its blocks are iresnet_tiny's at full width, and CPU fp16
# convolutions at that width take over a minute (bf16's 14 CPU-s on AVX2: make test-long).
@pytest.mark.half
@pytest.mark.parametrize(("name", "dtype"), [
    ("iresnet_tiny", torch.bfloat16), ("iresnet_tiny", torch.float16),
    pytest.param("iresnet18", torch.bfloat16, marks=pytest.mark.long),
    ("mobilefacenet", torch.bfloat16), ("mobilefacenet", torch.float16),
], ids=["iresnet_tiny-bf16", "iresnet_tiny-fp16", "iresnet18-bf16", "mobilefacenet-bf16",
        "mobilefacenet-fp16"])
def test_parameters_cast_to_low_precision_as_deepspeed_does(name, dtype):
    """DeepSpeed's bf16/fp16 modes cast the parameters and leave BatchNorm's running
    statistics fp32. A train step must run, keep the statistics fp32, and compute what torch's
    autocast computes for the fp32 model (DDP's bf16 path): the same low-precision convolutions
    on the same rounded weights, BatchNorm with fp32 statistics. The deeper iResNets use the
    same blocks (partial_fc.backbones.norm)."""
    torch.manual_seed(0)
    ref = build_backbone(name, embedding_size=24).train()
    low = build_backbone(name, embedding_size=24).train()
    low.load_state_dict(ref.state_dict())
    for p in low.parameters():
        p.data = p.data.to(dtype)
    x = torch.rand(2, 3, 112, 112) * 2 - 1  # BatchNorm's batch statistics need 2
    with torch.autocast("cpu", dtype=dtype):
        expected = ref(x).float()
    out = low(x.to(dtype))
    out.float().square().sum().backward()
    assert out.dtype == dtype
    assert all(p.grad is not None and p.grad.dtype == dtype
               for p in low.parameters() if p.requires_grad)
    for (key, got), want in zip(low.state_dict().items(), ref.state_dict().values(), strict=True):
        if "running" in key:
            assert got.dtype == torch.float32, key
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5, msg=key)
    # the same kernels on the same rounded operands: each output within one rounding to
    # dtype (an ulp at the value) and an fp32 sum order of the other (equal on AVX-512 BF16,
    # AVX2 and the default ISA)
    excess = rounding_excess(out, expected, dtype=dtype)
    assert excess <= 1, f"{name} {dtype}: {excess:.3g} of a rounding from autocast's"
