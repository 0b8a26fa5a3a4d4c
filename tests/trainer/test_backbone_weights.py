"""``backbone.weights``: initial weights from a local file, strictly, for native and timm
backbones (into the timm model itself; the embedding layer keeps its initialisation)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partial_fc.backbones import build_backbone
from partial_fc.backbones.timm_adapter import TimmBackbone
from trainer.checkpoint import CheckpointError
from trainer.checkpoint.backbone import load_initial_weights


def test_native_backbone_loads_its_state_dict(tmp_path):
    torch.manual_seed(1)
    source = build_backbone("vit_t", 8, depth=1)
    torch.save(source.state_dict(), tmp_path / "w.pth")
    torch.manual_seed(2)
    model = build_backbone("vit_t", 8, depth=1)
    load_initial_weights(model, tmp_path / "w.pth")
    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_timm_weights_go_into_the_trunk(tmp_path):
    trunk = nn.Sequential(nn.Conv2d(3, 4, 8, stride=8), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    trunk.num_features = 4
    torch.save({k: torch.full_like(v, 0.5) for k, v in trunk.state_dict().items()},
               tmp_path / "timm.pth")
    model = TimmBackbone(trunk, embedding_size=6)
    fc = model.fc.weight.detach().clone()
    load_initial_weights(model, tmp_path / "timm.pth")
    assert all((v == 0.5).all() for v in model.trunk.state_dict().values())
    assert torch.equal(model.fc.weight, fc)


def test_weights_that_do_not_fit_or_do_not_load_are_one_line(tmp_path):
    model = build_backbone("iresnet_tiny", 8)
    torch.save(build_backbone("vit_t", 8, depth=1).state_dict(), tmp_path / "other.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="other.pth'?: does not fit the backbone"):
        load_initial_weights(model, tmp_path / "other.pth")
    with pytest.raises(CheckpointError, match="junk.pth'?: not a readable state_dict"):
        load_initial_weights(model, tmp_path / "junk.pth")
