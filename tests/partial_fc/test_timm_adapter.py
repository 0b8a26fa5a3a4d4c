"""``timm:<model>`` backbones: the adapter on a stand-in ``timm`` module, and real timm models
where timm is installed (``pip install 'partial-fc[timm]'``)."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
from torch import nn

from partial_fc.backbones import build_backbone
from partial_fc.backbones.timm_adapter import TimmBackbone


class _Cnn(nn.Module):
    """A timm-like CNN: ``num_classes=0`` leaves pooled features; no ``img_size``."""

    num_features = 6

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        assert num_classes == 0
        self.conv = nn.Conv2d(3, 6, 3, stride=4)

    def forward(self, x):
        return self.conv(x).mean((2, 3))


class _Vit(_Cnn):
    """A timm-like ViT: needs ``img_size`` for its position embedding; names it as timm does."""

    def __init__(self, num_classes: int, img_size: int) -> None:
        super().__init__(num_classes)
        self.pos_embed = nn.Parameter(torch.zeros(1, (img_size // 4) ** 2, 6))

    def no_weight_decay(self):
        return {"pos_embed"}

    def forward(self, x):
        return (self.conv(x).flatten(2).transpose(1, 2) + self.pos_embed).mean(1)


@pytest.fixture
def fake_timm(monkeypatch):
    """A ``timm`` module with two models, where ``import timm`` finds it."""
    made = []

    def create_model(name, pretrained=False, **kwargs):
        assert pretrained is False  # never a download
        made.append((name, kwargs))
        return {"cnn": _Cnn, "vit": _Vit}[name](**kwargs)

    module = types.SimpleNamespace(is_model=lambda n: n in ("cnn", "vit"),
                                   create_model=create_model)
    monkeypatch.setitem(sys.modules, "timm", module)
    return made


@pytest.mark.parametrize("model", ["cnn", "vit"])
def test_adapter_builds_and_trains(fake_timm, model):
    net = build_backbone(f"timm:{model}", embedding_size=12, dropout=0.1)
    assert isinstance(net, TimmBackbone) and net.fc.in_features == 6
    if model == "vit":  # the ViT takes the 112x112 input size; the CNN is built without it
        assert fake_timm == [("vit", {"num_classes": 0, "img_size": 112})]
        assert net.no_weight_decay() == {"trunk.pos_embed"}
    else:
        assert fake_timm[-1] == ("cnn", {"num_classes": 0})
        assert net.no_weight_decay() == set()
    x = (torch.rand(3, 3, 112, 112) * 2 - 1).requires_grad_()
    out = net.train()(x)
    assert out.shape == (3, 12)
    out.square().sum().backward()
    assert all(p.grad is not None for p in net.parameters())


def test_unknown_model_and_missing_timm(fake_timm, monkeypatch):
    with pytest.raises(ValueError, match="timm has no model 'nope'"):
        build_backbone("timm:nope")
    with pytest.raises(ValueError, match="has no checkpointed blocks"):
        build_backbone("timm:cnn", checkpointing=1)
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError
    with pytest.raises(ValueError, match=r"needs timm: pip install 'partial-fc\[timm\]'"):
        build_backbone("timm:cnn")


_NO_TIMM = "timm is not installed (pip install 'partial-fc[timm]'; it needs a torchvision " \
           "built for this torch)"


@pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason=_NO_TIMM)
@pytest.mark.parametrize("model", ["resnet18", "vit_tiny_patch16_224"])
def test_real_timm_models(model):
    """One CNN and one ViT of timm on 112x112 faces: shape, gradients."""
    torch.manual_seed(0)
    net = build_backbone(f"timm:{model}", embedding_size=16).train()
    out = net(torch.rand(2, 3, 112, 112) * 2 - 1)
    assert out.shape == (2, 16)
    out.square().sum().backward()
    assert all(p.grad is not None for p in net.parameters() if p.requires_grad)
