"""bench/train.py's timed runs: the backbone's ceiling and the trainer's step (built as
``launch.train`` builds it), each cut into :data:`PHASES` by :class:`Marks` (CUDA events on
CUDA, ``time.perf_counter`` on CPU), with the batches the step gets; bench/train.py's
docstring says what each phase holds and how the figures are read.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import time
import warnings

import torch

from data_pipeline import make_loader
from offline import plan
from partial_fc import PartialFC, build_margin
from partial_fc.backbones import build_backbone
from trainer.config import Config
from trainer.dist import DistEnv
from trainer.engine import Engine, make_optimizer

PHASES = ("data", "input", "bb fwd", "head fwd", "head bwd", "bb bwd", "optim", "other")


class Marks:
    """Named time points in stream order; ``segments()`` gives ms from each to the next."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.points: list[tuple[str, object]] = []

    def __call__(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points.append((name, event))
        else:
            self.points.append((name, time.perf_counter()))

    def segments(self) -> dict[str, float]:
        """``{name: ms from the previous mark to this one}`` (reset afterwards)."""
        if self.cuda:
            torch.cuda.synchronize()
            gap = lambda a, b: a.elapsed_time(b)  # noqa: E731
        else:
            gap = lambda a, b: (b - a) * 1e3  # noqa: E731
        out = {name: gap(t0, t1) for (_, t0), (name, t1) in itertools.pairwise(self.points)}
        self.points.clear()
        return out


def run_config(args: argparse.Namespace, classes: int, rate: float, device: torch.device,
            engine: dict | None = None) -> Config:
    """The run's config; ``engine``: a ``--variant``'s ``engine.*`` keys over the flags'."""
    data = {"num_classes": classes}
    if args.workers is not None:
        data["num_workers"] = args.workers
    return Config.model_validate({
        "device": device.type,
        "data": data,
        "backbone": {"name": args.backbone, "checkpointing": args.checkpointing,
                     "depth": args.depth},
        "head": {"sample_rate": rate, "kernel": args.kernel, "state_dtype": args.state_dtype},
        "train": {"batch_size": args.batch},
        "engine": {"type": args.engine, "precision": args.precision, "compile": args.compile,
                   "channels_last": not args.nchw, **(engine or {})},
    })


def _batches(args: argparse.Namespace, cfg: Config, device: torch.device):
    """Endless (uint8 images, labels) batches: from the loader over ``args.data_dir`` (epoch
    after epoch, as ``launch.train`` iterates it), or 4 synthetic ones cycled on the host."""
    pin = device.type == "cuda"
    if args.data_dir is not None:
        loader = make_loader(args.data_dir, batch_size=args.batch, seed=cfg.seed,
                             num_workers=cfg.data.num_workers, flip=cfg.data.flip,
                             pin_memory=pin)
        for epoch in itertools.count():
            loader.set_epoch(epoch)
            yield from loader
    gen = torch.Generator().manual_seed(0)
    made = [(torch.randint(0, 256, (args.batch, 3, 112, 112), dtype=torch.uint8, generator=gen),
             torch.randint(0, cfg.data.num_classes, (args.batch,), generator=gen))
            for _ in range(4)]
    if pin:
        made = [(x.pin_memory(), y.pin_memory()) for x, y in made]
    yield from itertools.cycle(made)


def _collect(rows: list[dict[str, float]], warmup: int) -> dict[str, tuple[float, float]]:
    kept = rows[warmup:]
    out = {}
    for key in kept[0]:
        values = sorted(r[key] for r in kept)
        if len(values) >= 2:
            q = statistics.quantiles(values, n=10)
            spread = (q[-1] - q[0]) / 2
        else:
            spread = 0.0
        out[key] = (statistics.median(values), spread)
    return out


def run_ceiling(args: argparse.Namespace, device: torch.device) -> dict:
    cfg = run_config(args, 2, 1.0, device)
    torch.manual_seed(0)
    fmt = (torch.channels_last if device.type == "cuda" and cfg.engine.channels_last
           else torch.contiguous_format)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.cuda.reset_peak_memory_stats(device)
    model = build_backbone(**cfg.backbone.build_kwargs()).to(device, memory_format=fmt)
    opt = make_optimizer(cfg.optim, model)
    if args.compile:
        model = torch.compile(model)
    x = torch.randn(args.batch, 3, 112, 112, device=device).to(memory_format=fmt)
    cast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    marks, rows = Marks(device), []
    for _ in range(args.warmup + args.steps):
        marks("start")
        with cast:
            emb = model(x)
        marks("bb fwd")
        emb.float().square().mean().backward()
        marks("bb bwd")
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks("optim")
        rows.append(marks.segments())
    return _with_peak(_collect([{**r, "step": sum(r.values())} for r in rows], args.warmup),
                      device)


def run_step(args: argparse.Namespace, env: DistEnv, classes: int, rate: float,
             engine_keys: dict | None = None) -> dict:
    device = env.device
    cfg = run_config(args, classes, rate, device, engine_keys)
    torch.manual_seed(0)
    head = PartialFC(cfg.backbone.embedding_size, classes, build_margin(cfg.margin_kwargs()),
                     process_group=env.group, seed=cfg.seed, device=device,
                     **cfg.partial_fc_kwargs())  # as launch.train builds it
    engine = Engine(cfg, build_backbone(**cfg.backbone.build_kwargs()), head, env,
                    total_steps=args.warmup + args.steps, warmup_steps=0)
    marks = Marks(device)
    engine.backend.model.register_forward_pre_hook(lambda *_: marks("input"))
    engine.backend.model.register_forward_hook(lambda *_: marks("bb fwd"))
    engine.head.register_forward_hook(lambda *_: marks("head fwd"))
    # Fires when the backbone's output gradient is ready: the start of its backward. torch
    # warns that the images need no gradient, which is what the step intends.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    engine.backend.model.register_full_backward_pre_hook(lambda *_: marks("head bwd"))
    engine.optimizer.register_step_pre_hook(lambda *_: marks("bb bwd"))
    engine.head_optimizer.register_step_post_hook(lambda *_: marks("optim"))
    batches, rows = _batches(args, cfg, device), []
    groups = engine.prefetch([batch] for batch in batches)  # as trainer.loop hands them over
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        for step in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            group = next(groups)
            data_ms = (time.perf_counter() - t0) * 1e3
            marks("start")
            engine.step(step, group)
            marks("other")
            seg = marks.segments()
            rows.append({"data": data_ms, **seg, "step": data_ms + sum(seg.values())})
    finally:
        batches.close()  # ends the loader's workers
    return _with_peak(_collect(rows, args.warmup), device)


def _with_peak(out: dict, device: torch.device) -> dict:
    """Adds CUDA's peak allocated GiB of the run, then frees what the run left cached."""
    gc.collect()
    if device.type == "cuda":
        out["peak GiB"] = (torch.cuda.max_memory_allocated(device) / plan.GIB, 0.0)
        torch.cuda.empty_cache()
    return out
