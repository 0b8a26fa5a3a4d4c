"""A real timm model trained by ``launch.train`` (``backbone.name=timm:<model>``): initial
weights from a local timm state_dict, a loss that falls, a resume that continues the run,
and an ONNX export that reproduces the trained model."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from launch_helpers import train_in_process
from timm_env import import_timm

from launch.export import main as export
from trainer.checkpoint.backbone import load_backbone
from trainer.telemetry import run_files

MODEL = "resnet18"


@pytest.mark.slow
@pytest.mark.long  # ~19 CPU-s; make test keeps the adapter's tests (test_timm_adapter.py)
def test_timm_backbone_trains_resumes_and_exports(synthetic_data, tmp_path):
    timm = import_timm()
    torch.manual_seed(3)
    trunk = timm.create_model(MODEL, num_classes=0)
    torch.save(trunk.state_dict(), tmp_path / "trunk.pth")  # a user's local timm weights
    run = tmp_path / "run"
    common = (f"backbone.name=timm:{MODEL}", f"backbone.weights={tmp_path / 'trunk.pth'}",
              "backbone.embedding_size=32", "margin.s=16", "optim.lr=0.05")

    assert train_in_process(synthetic_data, run, *common, "train.max_steps=12") == 0
    losses = [r["loss"] for r in run_files.read_jsonl(run / "metrics.jsonl")]
    assert len(losses) == 12 and np.isfinite(losses).all()
    assert np.mean(losses[-3:]) < np.mean(losses[:3])

    assert train_in_process(synthetic_data, run, *common, "train.max_steps=15") == 0
    steps = [r["step"] for r in run_files.read_jsonl(run / "metrics.jsonl")]
    assert steps == list(range(1, 16))  # resumed at 12, not started over

    model, _ = load_backbone(run)
    assert type(model.trunk) is type(trunk)
    out = tmp_path / "model.onnx"
    assert export(["--checkpoint", str(run), "--out", str(out)]) == 0
    images = torch.rand(3, 3, 112, 112) * 2 - 1
    with torch.no_grad():
        want = model(images).numpy()
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(None, {"images": images.numpy()})[0]
    cos = (want * got).sum(1) / np.linalg.norm(want, axis=1) / np.linalg.norm(got, axis=1)
    assert cos.min() > 0.9999
