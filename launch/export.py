"""Export a trained backbone (backbone only; the head is a training device) to ONNX, or to a
folder of safetensors weights with a model card.

    python -m launch.export --checkpoint RUN --out model.onnx
    python -m launch.export --checkpoint RUN --format safetensors --license mit --out FOLDER

``--format safetensors`` writes ``FOLDER/model.safetensors``, ``config.json`` (architecture,
embedding size, input size and normalisation, flip TTA;
``trainer.pretrained.load_pretrained(FOLDER)`` reads it back) and ``README.md``, a model card in
the Hugging Face Hub's format filled from the run (data, margin, steps, the newest evaluation,
the licence stated by ``--license``);
``huggingface_hub.upload_folder`` publishes the folder as it is. Nothing is uploaded.

    python -m launch.export --checkpoint RUN --out model.onnx --int8 --bin lfw.bin --max-drop 0.5
    python -m launch.export --checkpoint RUN --out model.onnx --int8 --ijb /data/IJB_release

``--int8`` also writes ``model.int8.onnx``: static INT8 through ONNX Runtime's quantization
(``offline.int8``), calibrated on ``--calibration-samples`` images spread over the run's
training shards (``data.dir``, or ``--calibration-data``). It prints the accuracy and TAR@FAR
of fp32 and INT8 on each ``--bin``, and the TAR@FAR of the IJB 1:1 protocol (``--ijb``,
``--ijb-target``), with their differences; when a difference passes ``--max-drop``
percentage points the INT8 file is not kept and the program ends with one ``error:`` line.

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

from data_pipeline.errors import DataError
from data_pipeline.ijb import TARGETS, read_ijb_meta
from launch.cli import (
    checkpoint_program_parser,
    load_backbone_or_exit,
    resolve_checkpoint_or_exit,
)
from offline.int8 import calibration_images, int8_costs, quantize_int8
from offline.model_card import card_facts, model_card
from partial_fc.pretrained import PretrainedConfig, save_pretrained
from trainer.checkpoint.backbone import backbone_spec
from trainer.yaml_file import YamlRefused, read_mapping

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


def export_int8(fp32: Path, calibration_data: Path, samples: int, max_drop: float,
                bins: Sequence[Path], ijb: Path | None = None, ijb_target: str = "IJBC") -> int:
    """``fp32``'s INT8 twin beside it (``X.int8.onnx``), kept only when no figure of any set
    (``bins``, the IJB folder's 1:1 protocol) drops more than ``max_drop``; the exit status."""
    out = fp32.with_suffix(".int8.onnx")
    quantize_int8(fp32, out, calibration_images(calibration_data, samples))
    try:
        costs = int8_costs(fp32, out, bins, ijb, ijb_target)
    except DataError as err:
        out.unlink()
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(line for cost in costs for line in cost.lines()))
    drop, figure, name = max((d, k, c.name) for c in costs for k, d in c.drops.items())
    if drop > max_drop:
        out.unlink()
        print(f"error: INT8 costs {drop:.2f} pp of {figure} on {name} "
              f"(> --max-drop {max_drop}); not written, {fp32} is the fp32 model",
              file=sys.stderr)
        return 1
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB); worst cost {figure} on {name} "
          f"{drop:+.2f} pp <= --max-drop {max_drop}")
    return 0


def _calibration_folder(args) -> Path:
    if args.calibration_data is not None:
        return args.calibration_data
    config_path, _ = resolve_checkpoint_or_exit(args.checkpoint)
    try:
        section = read_mapping(config_path).get("data")
    except YamlRefused as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    folder = section.get("dir") if isinstance(section, dict) else None
    if folder is None or not (Path(folder) / "manifest.json").is_file():
        print(f"error: {config_path}: data.dir={folder!r} holds no manifest.json to calibrate "
              "on; give --calibration-data DIR (training shards)", file=sys.stderr)
        raise SystemExit(2)
    return Path(folder)


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
    p.add_argument("--int8", action="store_true",
                   help="also write OUT with .int8.onnx: static INT8, its cost measured on "
                   "--bin and/or --ijb")
    p.add_argument("--bin", type=Path, nargs="+", default=[],
                   help="--int8: verification .bin(s) on which fp32 and INT8 are compared")
    p.add_argument("--ijb", type=Path, metavar="DIR", default=None,
                   help="--int8: also compare them on this IJB_release folder's 1:1 protocol "
                   "(TAR@FAR, as python -m launch.evaluate --ijb scores it)")
    p.add_argument("--ijb-target", choices=TARGETS, default="IJBC",
                   help="--ijb: the protocol compared on (default IJBC)")
    p.add_argument("--max-drop", type=float, default=1.0,
                   help="--int8: refuse when accuracy or a TAR@FAR drops more than this many "
                   "percentage points (default 1.0)")
    p.add_argument("--calibration-data", type=Path, default=None,
                   help="--int8: shard folder to calibrate on (default: the run's data.dir)")
    p.add_argument("--calibration-samples", type=int, default=256,
                   help="--int8: calibration images, spread over the shards (default 256)")
    args = p.parse_args(argv)
    if args.int8 and (args.format != "onnx" or not (args.bin or args.ijb)):
        p.error("--int8 needs --format onnx and --bin X.bin and/or --ijb DIR (where its cost "
                "is measured)")
    if args.format == "safetensors":
        if not args.license:
            p.error("--format safetensors needs --license (the licence you publish under)")
        out = export_pretrained(args.checkpoint, args.out, args.license)
        print(f"wrote {out}/ (model.safetensors, config.json, README.md)")
        return 0
    calibration = _calibration_folder(args) if args.int8 else None
    if args.int8 and args.ijb is not None:
        try:  # before the export and the quantization, which take minutes on a large model
            read_ijb_meta(args.ijb, args.ijb_target)
        except DataError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    backbone = load_backbone_or_exit(args.checkpoint)
    export_onnx(backbone, args.out, args.opset)
    cosine = check_onnx(backbone, args.out)
    print(f"wrote {args.out} ({type(backbone).__name__}, {args.out.stat().st_size / 2**20:.1f} "
          f"MiB); ONNX Runtime vs PyTorch min cosine {cosine:.6f}")
    if cosine < args.min_cosine:
        print(f"error: {args.out}: min cosine {cosine:.6f} < --min-cosine {args.min_cosine}",
              file=sys.stderr)
        return 1
    if calibration is not None:
        return export_int8(args.out, calibration, args.calibration_samples, args.max_drop,
                           args.bin, args.ijb, args.ijb_target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
