"""Static INT8 quantization of an exported backbone, and what it costs in verification.

ONNX Runtime's static quantization (``quantize_static``, QDQ format: weights per output
channel, activations per tensor, both signed 8-bit) fixes every activation's range from a
calibration set instead of measuring it at run time. The calibration images are a sample of
the training shards, spread evenly over them, normalised as training normalises
(``partial_fc.backbones.normalize_images``).

A face model's INT8 error shows at low FAR before it shows in accuracy: the impostor scores'
tail moves. :func:`int8_costs` therefore scores the fp32 and the INT8 model on the same ``.bin``
sets and IJB protocol through the same evaluation code (flip TTA, 10-fold accuracy, TAR@FAR;
IJB's template pooling) and reports the drop of each figure.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quant_pre_process,
    quantize_static,
)

from data_pipeline.codec import decode_image, resolve_decoder
from data_pipeline.manifest import read_manifest
from data_pipeline.tar_reader import tar_samples
from partial_fc.backbones import normalize_images
from partial_fc.eval.verification import resolves
from trainer.evaluation import evaluate_bins, evaluate_ijb_dir
from trainer.onnx_backbone import OnnxBackbone


def calibration_images(data_dir: str | Path, count: int) -> np.ndarray:
    """``count`` training images, uint8 ``[count, 3, 112, 112]``, at evenly spaced positions
    of the data set (every shard contributes in proportion to its size; deterministic)."""
    manifest = read_manifest(data_dir)
    count = min(count, manifest.num_samples)
    wanted = set(np.linspace(0, manifest.num_samples - 1, count).round().astype(int).tolist())
    decoder = resolve_decoder("auto")
    images, first = [], 0
    for shard in manifest.shards:
        positions = {i - first for i in wanted if first <= i < first + shard.count}
        first += shard.count
        if not positions:
            continue
        for number, sample in enumerate(tar_samples(Path(data_dir) / shard.name,
                                                    exts=("jpg",))):
            if number in positions:
                images.append(decode_image(sample["jpg"], 112, decoder).transpose(2, 0, 1))
    return np.stack(images)


# A standalone BatchNorm (iResNet's pre-activation ones cannot fold into a convolution) has
# rank-1 per-channel weights: their channel axis is 0, not ONNX Runtime's default 1.
_CHANNEL_AXES = {"BatchNormalization": 0}


class _Calibration(CalibrationDataReader):
    """Feeds ONNX Runtime's calibrator normalised batches of the calibration images."""

    def __init__(self, images: np.ndarray, input_name: str, batch_size: int = 32) -> None:
        self.batches: Iterator[dict[str, np.ndarray]] = iter([
            {input_name: normalize_images(torch.from_numpy(images[i:i + batch_size])).numpy()}
            for i in range(0, len(images), batch_size)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.batches, None)


def quantize_int8(fp32: str | Path, out: str | Path, images: np.ndarray) -> Path:
    """Write the static INT8 (QDQ) model of the ONNX file ``fp32`` to ``out``, calibrated on
    ``images`` (uint8 ``[N, 3, 112, 112]``; min-max ranges). ONNX Runtime's pre-processing
    (shape inference, graph optimisation) runs first, as its documentation asks."""
    out = Path(out)
    input_name = ort.InferenceSession(str(fp32), providers=["CPUExecutionProvider"]
                                      ).get_inputs()[0].name
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        quant_pre_process(str(fp32), str(prepared), skip_symbolic_shape=True)
        quantize_static(str(prepared), str(out), _Calibration(images, input_name),
                        quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        extra_options={"QDQOpTypePerChannelSupportToAxis": _CHANNEL_AXES})
    return out


@dataclass(frozen=True)
class Int8Cost:
    """The fp32 and INT8 figures on one set (a ``.bin``, or an IJB 1:1 protocol); ``drops`` in
    percentage points (fp32 minus INT8; positive is a loss), for the accuracy (``.bin``) and
    each TAR@FAR."""

    name: str
    fp32: dict[str, float]
    int8: dict[str, float]

    @property
    def drops(self) -> dict[str, float]:
        keys = [*(["accuracy"] if "accuracy" in self.fp32 else []),
                *sorted(k for k in self.fp32 if k.startswith("tar@far="))]
        return {k: 100 * (self.fp32[k] - self.int8[k]) for k in keys}

    def lines(self) -> list[str]:
        """One line per figure; a TAR at a FAR the set's impostor pairs cannot resolve is
        marked ``*`` (the nearest achievable FAR, as ``launch.evaluate`` marks it)."""
        def mark(key: str) -> str:
            far = key.removeprefix("tar@far=")
            return "*" if far != key and not resolves(self.fp32["impostor_pairs"],
                                                       float(far)) else ""
        return [f"{self.name} {k}{mark(k)}: fp32 {100 * self.fp32[k]:.2f}  int8 "
                f"{100 * self.int8[k]:.2f}  cost {drop:+.2f} pp"
                for k, drop in self.drops.items()]


def int8_costs(fp32: str | Path, int8: str | Path, bins: Sequence[str | Path] = (),
               ijb: str | Path | None = None, ijb_target: str = "IJBC",
               batch_size: int = 64) -> list[Int8Cost]:
    """Score both ONNX models on the verification sets ``bins`` and, given an IJB folder, on
    its ``ijb_target`` 1:1 protocol (``trainer.evaluation.evaluate_ijb_dir``: template
    pooling with the image norms kept, TAR at the IJB FARs), in one process; one cost per set,
    the ``.bin`` sets first. Raises DataError when a set cannot be read."""
    scores = []
    for model in (fp32, int8):
        backbone = OnnxBackbone(model)
        found = evaluate_bins(backbone, list(bins), batch_size, "cpu")
        if ijb is not None:
            found |= evaluate_ijb_dir(backbone, ijb, ijb_target, batch_size, "cpu")
        scores.append(found)
    return [Int8Cost(name, scores[0][name], scores[1][name]) for name in scores[0]]
