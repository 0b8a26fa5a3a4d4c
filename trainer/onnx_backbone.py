"""An ONNX backbone behind the ``nn.Module`` interface: INT8 evaluation and ONNX teachers."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import torch
from torch import nn


class OnnxBackbone(nn.Module):
    """An ONNX file (input ``images`` ``[N, 3, 112, 112]`` float32 in [-1, 1], output
    ``[N, D]``) behind the backbone interface the evaluation and embedding code call.

    Inference only, on CPU through ONNX Runtime (the output goes back to the input's
    device). It holds one empty float32 parameter
    because the callers cast their inputs to ``next(backbone.parameters()).dtype``.
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name
        self.dtype_anchor = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.detach().float().cpu().contiguous().numpy()
        return torch.from_numpy(self.session.run(None, {self.input_name: x})[0]).to(images.device)
