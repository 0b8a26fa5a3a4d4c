"""Export a trained backbone (backbone only; the head is a training device) to ONNX, or to a
folder of safetensors weights with a model card.

    python -m launch.export --checkpoint RUN --out model.onnx
    python -m launch.export --checkpoint RUN --format safetensors --license mit --out FOLDER

``--format safetensors`` writes ``FOLDER/model.safetensors``, ``config.json`` (architecture,
embedding size, input size and normalisation, flip TTA; ``partial_fc.load_pretrained(FOLDER)``
reads it back) and ``README.md``, a model card in the Hugging Face Hub's format filled from
the run (data, margin, steps, the newest evaluation, the licence stated by ``--license``);
``huggingface_hub.upload_folder`` publishes the folder as it is. Nothing is uploaded.

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

from launch.cli import (
    checkpoint_program_parser,
    load_backbone_or_exit,
    resolve_checkpoint_or_exit,
)
from partial_fc.pretrained import PretrainedConfig, save_pretrained
from trainer.checkpoint.backbone import backbone_spec
from trainer.model_card import card_facts, model_card

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


def export_pretrained(checkpoint: str, out: Path, license: str) -> Path:
    """The ``--format safetensors`` folder of ``checkpoint``; returns ``out``."""
    config_path, weights = resolve_checkpoint_or_exit(checkpoint)
    backbone = load_backbone_or_exit(weights)
    facts = card_facts(config_path, weights, license)
    spec = backbone_spec(facts.config, config_path)
    config = PretrainedConfig(architecture=spec["name"], embedding_size=spec["embedding_size"],
                              depth=spec["depth"])
    save_pretrained(backbone, out, config)
    (out / "README.md").write_text(model_card(facts))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = checkpoint_program_parser("launch.export", __doc__)
    p.add_argument("--out", required=True, type=Path,
                   help="ONNX file to write, or the folder of --format safetensors")
    p.add_argument("--format", choices=("onnx", "safetensors"), default="onnx",
                   help="onnx: one .onnx file; safetensors: weights, config.json, model card")
    p.add_argument("--license", default=None,
                   help="--format safetensors: the licence the weights are published under "
                   "(a Hugging Face Hub id such as apache-2.0, mit, cc-by-nc-4.0, or any name)")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default: exporter's)")
    p.add_argument("--min-cosine", type=float, default=0.9999,
                   help="fail if ONNX Runtime and PyTorch disagree more than this")
    args = p.parse_args(argv)
    if args.format == "safetensors":
        if not args.license:
            p.error("--format safetensors needs --license (the licence you publish under)")
        out = export_pretrained(args.checkpoint, args.out, args.license)
        print(f"wrote {out}/ (model.safetensors, config.json, README.md)")
        return 0
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
