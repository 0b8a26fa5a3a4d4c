"""Export a trained backbone to ONNX (backbone only; the head is a training device).

    python -m launch.export --checkpoint RUN --out model.onnx

The graph maps float32 ``images [batch, 3, 112, 112]`` in [-1, 1] (see
``partial_fc.backbones.normalize_images``) to ``embeddings [batch, D]``
(un-normalised, no flip TTA), with a dynamic batch axis. It is written by the
``torch.export``-based exporter (``dynamo=True``, the default since PyTorch 2.9;
the TorchScript one is deprecated) as a single file, then checked: ONNX Runtime
and PyTorch must agree (cosine >= ``min_cosine``) on random batches of two sizes.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from launch.cli import checkpoint_program_parser, load_backbone_or_exit

# The exporter's registry logs one warning per torchvision op it cannot register (detection
# ops such as nms; a backbone uses none of them), and torch.export's pickling of tree specs
# warns about a deprecation inside torch. Neither is anything a user of this command can act on.
_REGISTRY_LOGGER = "torch.onnx._internal.exporter._registration"
_TORCH_DEPRECATION = r".*isinstance\(treespec, LeafSpec\)` is deprecated"


def export_onnx(backbone: nn.Module, out: str | os.PathLike, opset: int | None = None) -> Path:
    """Write ``backbone`` (set to eval mode) as a single-file ONNX model with a dynamic batch."""
    out = Path(out)
    backbone = backbone.eval()
    example = torch.rand(2, 3, 112, 112) * 2 - 1
    logging.getLogger(_REGISTRY_LOGGER).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TORCH_DEPRECATION, category=FutureWarning)
        torch.onnx.export(
            backbone, (example,), out, dynamo=True, external_data=False, opset_version=opset,
            input_names=["images"], output_names=["embeddings"],
            dynamic_shapes=({0: torch.export.Dim("batch", min=1)},), verbose=False,
        )
    return out


def check_onnx(backbone: nn.Module, path: str | os.PathLike, batch_sizes=(1, 5)) -> float:
    """Smallest cosine between ONNX Runtime and PyTorch embeddings on random batches."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(0)
    worst = 1.0
    for batch in batch_sizes:
        x = torch.rand(batch, 3, 112, 112, generator=gen) * 2 - 1
        got = session.run(None, {"images": x.numpy()})[0]
        with torch.no_grad():
            want = backbone.eval()(x).numpy()
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        worst = min(worst, float(cos.min()))
    return worst


def main(argv: Sequence[str] | None = None) -> int:
    p = checkpoint_program_parser("launch.export", __doc__)
    p.add_argument("--out", required=True, type=Path, help="ONNX file to write")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default: exporter's)")
    p.add_argument("--min-cosine", type=float, default=0.9999,
                   help="fail if ONNX Runtime and PyTorch disagree more than this")
    args = p.parse_args(argv)
    backbone = load_backbone_or_exit(args.checkpoint)
    export_onnx(backbone, args.out, args.opset)
    cosine = check_onnx(backbone, args.out)
    print(f"wrote {args.out} ({type(backbone).__name__}, {args.out.stat().st_size / 2**20:.1f} "
          f"MiB); ONNX Runtime vs PyTorch min cosine {cosine:.6f}")
    if cosine < args.min_cosine:
        print(f"error: {args.out}: min cosine {cosine:.6f} < --min-cosine {args.min_cosine}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
