"""``timm:<model>`` backbones: the adapter on a stand-in ``timm`` module (the choices it makes),
and real timm models (in the test extra; ``tests/timm_env.py`` on how they import here)."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch
from timm_env import import_timm
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


@pytest.mark.parametrize("model", ["resnet18", "vit_tiny_patch16_224"])
def test_real_timm_models(model):
    """One CNN and one ViT of timm on 112x112 faces: the ViT's position embedding is built for
    112 (patch 16: 7x7 tokens), the embedding layer sits on the pooled features, every
    parameter gets a gradient, and the ViT's own no-decay names come through under trunk."""
    timm = import_timm()
    torch.manual_seed(0)
    net = build_backbone(f"timm:{model}", embedding_size=16).train()
    assert net.fc.in_features == timm.create_model(model, num_classes=0).num_features
    out = net(torch.rand(2, 3, 112, 112) * 2 - 1)
    assert out.shape == (2, 16)
    out.square().sum().backward()
    assert all(p.grad is not None for p in net.parameters() if p.requires_grad)
    if model.startswith("vit"):
        assert net.trunk.pos_embed.shape[1] == 1 + (112 // 16) ** 2  # class token + 7x7
        assert "trunk.pos_embed" in net.no_weight_decay()


def test_torchvision_that_does_not_load_is_one_line(monkeypatch):
    """A torchvision whose import fails (its C++ ops missing) is named, with the fix."""
    def broken(name):
        raise RuntimeError("operator torchvision::nms does not exist\n(traceback lines)")

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(ValueError, match=r"torchvision built for this torch") as err:
        build_backbone("timm:resnet18")
    assert "\n" not in str(err.value)
