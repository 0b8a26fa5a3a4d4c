"""The measured figures that plans and estimates start from, in ``plan_figures.json`` beside
this file: each with its date, machine and command.

The planner (``offline.plan``, behind ``launch.plan``) reads all of them; the config check
reads two (``trainer.config.pace``: a CPU step's length), which is why they live in the
trainer and not in the offline tools the trainer may not import.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from partial_fc import memory

FIGURES = Path(__file__).with_name("plan_figures.json")
"""The planner's measured inputs, each with its date, machine and command."""


@dataclass(frozen=True)
class Figures:
    """What :data:`FIGURES` holds, read by :func:`figures`.

    ``activations`` / ``block_activations``: bytes saved for backward per image (one ViT
    block's share), keyed ``(backbone, "fp32"|"bf16")``; a backbone missing here is measured
    when first asked for (``offline.plan.measure_activations``). ``r50_images_per_s``: iresnet50's
    single-H100 training throughput; ``head_matmul_flops_per_s``: the head's three matmuls';
    ``loader_images_per_s``: one loader worker's (one CPU core) images per second.
    ``forward_flops``: ``offline.plan.backbone_flops`` at D=512 per backbone name, tabled so
    that the config check (``trainer.config.pace``) needs no model; ``cpu_train_seconds_per_flop``:
    seconds of one CPU process's training step (forward, backward, optimizer) per forward
    flop of its images, from one measured iresnet50 step.
    """

    activations: dict[tuple[str, str], int]
    block_activations: dict[tuple[str, str], int]
    r50_images_per_s: float
    head_matmul_flops_per_s: float
    loader_images_per_s: float
    forward_flops: dict[str, int]
    cpu_train_seconds_per_flop: float


@functools.cache
def figures() -> Figures:
    """:data:`FIGURES`, read once."""
    data = json.loads(FIGURES.read_text())
    act, h100, loader, cpu = data["activations"], data["h100"], data["loader"], data["cpu_pace"]

    def table(entries: dict[str, int]) -> dict[tuple[str, str], int]:
        return {tuple(key.split("/")): value for key, value in entries.items()}

    shape = h100["head_matmul_shape"]
    flops = memory.head_matmul_flops(shape["n"], shape["classes"], shape["dim"])
    forward, step = data["forward_flops"]["per_image"], cpu["step"]
    return Figures(table(act["per_image"]), table(act["per_vit_block"]),
                   h100["iresnet50_images_per_s"], flops / h100["head_matmul_seconds"],
                   loader["images_per_cpu_s"], forward,
                   step["seconds"] / (forward[step["backbone"]] * step["batch"]))
