"""launch.export: ONNX Runtime reproduces the PyTorch embeddings with a dynamic batch axis."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from eval_helpers import (
    make_run,
)

from launch.export import main
from trainer.checkpoint.backbone import load_backbone


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.slow
@pytest.mark.parametrize("backbone", ["iresnet_tiny", "vit_t"])
def test_export_matches_pytorch_with_dynamic_batch(tmp_path, capsys, backbone):
    """iResNet and ViT (scaled_dot_product_attention, LayerNorm; one block)."""
    run = make_run(tmp_path, backbone=backbone, depth=1 if backbone == "vit_t" else None)
    out = tmp_path / "model.onnx"
    records = _Records()
    logging.getLogger("torch.onnx").addHandler(records)  # the exporter's own loggers
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert main(["--checkpoint", str(run), "--out", str(out)]) == 0
    finally:
        logging.getLogger("torch.onnx").removeHandler(records)
    assert capsys.readouterr().out.startswith(f"wrote {out} ")  # the one line, no progress
    assert not [m for m in records.messages if "torchvision" in m], records.messages
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]
    assert list(tmp_path.glob("model.onnx*")) == [out]  # one self-contained file

    graph = onnx.load(str(out)).graph
    batch_dim = graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param and not batch_dim.HasField("dim_value")  # symbolic batch

    model, _ = load_backbone(run)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for batch in (1, 3, 7):
        x = torch.rand(batch, 3, 112, 112, generator=torch.Generator().manual_seed(batch)) * 2 - 1
        got = session.run(None, {"images": x.numpy()})[0]
        with torch.no_grad():
            want = model(x).numpy()
        assert got.shape == (batch, 16)
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cos.min() >= 0.9999


def test_export_refuses_a_corrupt_checkpoint_in_one_line(tmp_path, capsys):
    run = make_run(tmp_path)
    weights = run / "checkpoints" / "step-00000010" / "backbone.pt"
    weights.write_bytes(weights.read_bytes()[:-1])  # truncated
    for path in (run, weights.parent):
        with pytest.raises(SystemExit) as caught:
            main(["--checkpoint", str(path), "--out", str(tmp_path / "model.onnx")])
        errors = [x for x in capsys.readouterr().err.splitlines() if not x.startswith("warning")]
        assert caught.value.code == 2 and len(errors) == 1 and errors[0].startswith("error: ")
        assert ("no checkpoint verifies" if path == run else "SHA-256 differs") in errors[0]
    assert not (tmp_path / "model.onnx").exists()
