"""Shared pieces of the trainer tests: a config, a BN-free backbone, batches, an Engine."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
NUM_CLASSES, EMBEDDING = 11, 16  # 11 classes: uneven over 2 and 3 ranks


def bench_module(name: str):
    """``bench/<name>.py`` as a module (bench/ holds scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_config(*overrides: str):
    from trainer.config import load_config

    base = [
        f"data.num_classes={NUM_CLASSES}",
        "engine.type=ddp",
        "train.clip_grad_norm=1.0",
        "margin.type=arcface",
        "margin.s=16.0",
    ]
    return load_config(ROOT / "configs" / "smoke.yaml", base + list(overrides), resolve=False)


def train_in_process(data, run, *overrides: str) -> int:
    """``python -m launch.train`` on the smoke config (ddp, batch 8, a metrics line per step),
    one rank, in this process; returns its exit status."""
    from launch.train import main

    return main(["--config", str(ROOT / "configs" / "smoke.yaml"), f"data.dir={data}",
                 f"output={run}", "engine.type=ddp", "train.batch_size=8", "data.num_workers=0",
                 "log.every=1", "log.progress=false", *overrides])


def tiny_backbone() -> nn.Module:
    """No BatchNorm, so a P-rank step can equal a 1-rank step exactly (BN stats are per rank)."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 16, stride=16),
        nn.Flatten(),
        nn.PReLU(4 * 7 * 7),
        nn.Linear(4 * 7 * 7, EMBEDDING),
    )


def tiny_batchnorm_backbone() -> nn.Module:
    """:func:`tiny_backbone` with the BatchNorm layers of an iResNet's stem and embedding
    (running statistics a step updates and a checkpoint carries), few enough operations that
    torch.compile builds a handful of kernels (iresnet_tiny: 31, ~2 CPU-s each)."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 16, stride=16),
        nn.BatchNorm2d(4),
        nn.PReLU(4),
        nn.Flatten(),
        nn.Linear(4 * 7 * 7, EMBEDDING),
        nn.BatchNorm1d(EMBEDDING),
    )


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    images = torch.randint(0, 256, (size, 3, 112, 112), generator=gen, dtype=torch.uint8)
    return images, torch.randint(0, NUM_CLASSES, (size,), generator=gen)


def local_micro_batches(step: int, size: int, rank: int, world: int, k: int) -> list:
    """Rank ``rank``'s share of global batch ``step``, cut into ``k`` micro-batches whose
    union over ranks, micro-batch by micro-batch, covers the global batch once."""
    images, labels = global_batch(step, size)
    per = size // (world * k)
    out = []
    for j in range(k):
        lo = (j * world + rank) * per
        out.append((images[lo : lo + per], labels[lo : lo + per]))
    return out


def build_engine(cfg, total_steps: int = 10, device: str = "cpu", backbone=None):
    """An Engine on ``cfg`` with :func:`tiny_backbone`, or ``backbone()``, in the process
    group already up (both drawn after the same seed)."""
    from partial_fc import PartialFC, build_margin
    from trainer.dist import attach
    from trainer.engine import Engine

    torch.manual_seed(0)
    backbone = (backbone or tiny_backbone)()
    head = PartialFC(EMBEDDING, NUM_CLASSES, build_margin(cfg.margin_kwargs()), seed=cfg.seed,
                     **cfg.partial_fc_kwargs())
    return Engine(cfg, backbone, head, attach(torch.device(device)), total_steps=total_steps,
                  warmup_steps=0)


def snapshot(engine) -> dict:
    """Everything a step changes, as plain CPU tensors (picklable across processes)."""
    head_opt = engine.head_optimizer.state.get(engine.head.weight, {})
    return {
        "backbone": {k: v.detach().clone() for k, v in engine.backbone.state_dict().items()},
        "rows": engine.head.weight.detach().clone(),
        "class_start": engine.head.class_start,
        "head_opt": {k: v.detach().clone() for k, v in head_opt.items()},
        "head_state": {
            k: v.detach().clone() for k, v in engine.head.state_dict().items() if k != "weight"
        },
    }


def same_snapshots(a: dict, b: dict) -> bool:
    """Whether two :func:`snapshot` s hold bit-identical head rows, backbone state, head
    optimizer state and head buffers."""
    return torch.equal(a["rows"], b["rows"]) and all(
        a[part].keys() == b[part].keys()
        and all(torch.equal(a[part][k], b[part][k]) for k in a[part])
        for part in ("backbone", "head_opt", "head_state"))


def full_rows(snaps: list[dict], key: str | None = None) -> torch.Tensor:
    """Concatenate per-rank row blocks (``rows`` or ``head_opt[key]``) in class order."""
    ordered = sorted(snaps, key=lambda s: s["class_start"])
    return torch.cat([s["rows"] if key is None else s["head_opt"][key] for s in ordered])
