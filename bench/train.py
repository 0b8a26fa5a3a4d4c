"""Benchmark: the trainer's step next to the backbone's own ceiling, on one device.

    python bench/train.py                                   # CUDA: iresnet50 bf16 batch 128
    python bench/train.py --device cpu                      # CPU: iresnet_tiny fp32 batch 8
    python bench/train.py --runs 1000:1.0,1000000:0.1 --steps 100 --warmup 20
    python bench/train.py --synthetic-data 1000 --workers 10   # batches from the real loader
    python bench/train.py --data DIR --compile              # a converted folder; torch.compile
    python bench/train.py --json figures.json               # the table's figures as JSON too
    python bench/train.py --backbone vit_b --checkpointing 1 --batch 256   # a ViT, checkpointed
    python bench/train.py --runs 1000:1.0 --variant wrapped=one_rank_ddp=true \
        --variant no-prefetch=prefetch=false --variant no-fused=fused_updates=false
    python bench/train.py --engine deepspeed --runs 1000:1.0 \
        --variant overlap=zero_settings.overlap_comm=1,zero_settings.contiguous_gradients=1

One process, a 1-rank process group (``trainer.dist.init_distributed``, no torchrun).

- ``ceiling``: the backbone alone, as the engine runs it (same batch, precision and memory
  format: channels_last on CUDA), on random input: forward, ``mean(emb^2)`` backward, the
  backbone's optimizer (``trainer.engine.make_optimizer``);
- each ``classes:rate`` of ``--runs``: the full step, ``trainer.engine.Engine.step`` with a
  ``partial_fc.PartialFC`` head of that many classes and sample rate, the batches handed over
  through ``Engine.prefetch`` as ``trainer.loop`` hands them; once with the engine's defaults
  and once more per ``--variant NAME=KEY=VALUE,...`` with those ``engine.*`` keys set (the
  step's overheads each switched back on: ``one_rank_ddp=true`` wraps the one rank in DDP,
  ``prefetch=false`` copies on the step's stream, ``fused_updates=false`` takes the chunked
  head update and per-tensor norms; ``zero_settings.KEY=N`` tries a DeepSpeed setting).

Batches: with ``--data DIR`` (or ``--synthetic-data K``, which first writes a K-class
synthetic webdataset folder to a temp dir with ``data_pipeline.write_synthetic_dataset``) they
come from ``data_pipeline.make_loader`` built as ``launch.train`` builds it (``--workers``
decoding processes, pinned memory on CUDA, flip), so ``data`` is the real wait for the next
batch. The head keeps the ``--runs`` class count and gets the data's labels: the step costs
what it costs on data of that many classes (all rows in the softmax at r=1, r*C sampled rows
otherwise). Without either, 4 synthetic uint8 batches (pinned on CUDA) cycle in memory: the
pure-compute view, where ``data`` is ~0 by construction. ``--compile`` sets
``engine.compile`` and compiles the ceiling's backbone too (the first ``--warmup`` steps
absorb the compile time; give enough of them).

Per step: ``data`` (host time to fetch the next batch, and on CUDA with ``engine.prefetch``
to queue its copy to the GPU), then the engine's step cut by hooks on the module the backend
runs (DDP's wrapper, DeepSpeed's engine, or on one rank the bare module: their hooks run
eagerly even with ``--compile``) and the head into ``input`` (host-to-device copy and
normalisation), ``bb fwd``, ``head fwd`` (its
collectives included), ``head bwd``, ``bb bwd`` (DDP's gradient all-reduce and clipping
included), ``optim`` (both optimizers) and ``other``. Times come from CUDA events on CUDA and
``time.perf_counter`` on CPU (synchronous there). One rank has no communication to speak of;
the table's last line gives what ``launch.plan`` models for ``--model-gpus`` GPUs. Cells are
the median over ``--steps`` after ``--warmup``, ``±`` half the 10th-90th percentile range.
Prints figures, asserts nothing; not run by the test suite.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from data_pipeline import read_manifest, write_synthetic_dataset
from offline import plan
from offline.plan_inputs import resolve_inputs
from trainer.dist import init_distributed, resolve_device, shutdown
from trainer.yaml_file import parse_yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ holds scripts, no package
from train_phases import PHASES, run_ceiling, run_config, run_step  # noqa: E402


def _planned(args: argparse.Namespace, classes: int, rate: float, gpus: int
             ) -> plan.PlanResult:
    given = {"classes": classes, "sample_rate": rate, "gpus": gpus, "batch": args.batch,
             "backbone": args.backbone, "precision": args.precision, "engine": args.engine,
             "reserve": 0.0, "state_dtype": args.state_dtype,
             "checkpointing": args.checkpointing}
    return plan.plan(resolve_inputs(None, given))


def _cell(stat: tuple[float, float] | None) -> str:
    return "-" if stat is None else f"{stat[0]:.2f}±{stat[1]:.2f}"


def _figures(args: argparse.Namespace, classes: int, rate: float, r: dict) -> dict:
    """One row's figures: img/s, the median ms of the step and its phases, the GiB."""
    planned = None if classes == 0 else \
        _planned(args, classes, rate, 1).peak_bytes_per_gpu / plan.GIB
    return {"img_per_s": args.batch / r["step"][0] * 1e3, "step_ms": r["step"][0],
            "phases_ms": {p: r[p][0] for p in PHASES if p in r},
            "peak_gib": r["peak GiB"][0] if "peak GiB" in r else None, "planned_gib": planned}


def write_json(args: argparse.Namespace, results: list[tuple[str, int, float, dict]],
               device: torch.device) -> None:
    """``--json PATH``: the table's figures, for ``bench/gpu_summary.py`` to merge."""
    setup = {key: getattr(args, key) for key in ("backbone", "batch", "precision", "engine",
                                                  "compile", "state_dtype", "steps", "warmup")}
    rows = [{"run": name, "classes": classes, "sample_rate": rate,
             **_figures(args, classes, rate, r)} for name, classes, rate, r in results]
    Path(args.json).write_text(json.dumps({"device": str(device), "torch": torch.__version__,
                                           **setup, "variants": dict(args.variant),
                                           "runs": rows}, indent=1) + "\n")


def print_table(args: argparse.Namespace, results: list[tuple[str, int, float, dict]]) -> None:
    cols = ["run", "img/s", "step ms", *PHASES, "peak GiB", "planned GiB"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for name, classes, rate, r in results:
        f = _figures(args, classes, rate, r)
        planned = "-" if f["planned_gib"] is None else f"{f['planned_gib']:.2f}"
        peak = "-" if f["peak_gib"] is None else f"{f['peak_gib']:.2f}"
        lines.append(" | ".join([name, f"{f['img_per_s']:,.0f}", _cell(r["step"]),
                                 *(_cell(r.get(p)) for p in PHASES), peak, planned]))
    print("\n".join(f"| {line} |" for line in lines))
    if len(results) > 1:  # the step's collectives depend on N, D and the backbone, not on C
        _, classes, rate, _ = results[1]
        p = _planned(args, classes, rate, args.model_gpus)
        print(f"communication per step at {args.model_gpus} GPUs, modelled by launch.plan "
              f"({p.link} link, {p.link_bytes_per_s / 1e9:g} GB/s per GPU): "
              f"{p.comm_seconds * 1e3:.2f} ms")


def _runs(text: str) -> list[tuple[int, float]]:
    try:
        return [(int(c), float(r)) for c, r in (item.split(":") for item in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--runs={text!r}: expected classes:rate,...") from None


def _variant(text: str) -> tuple[str, dict]:
    """``NAME=KEY=VALUE,...`` -> ``(NAME, engine keys)``; ``zero_settings.KEY`` nests, values
    are YAML scalars (``true``, ``1``, ``5e7`` as written)."""
    name, _, keys = text.partition("=")
    engine: dict = {}
    try:
        for item in keys.split(","):
            key, value = item.split("=")
            section, _, sub = key.partition(".")
            target = engine.setdefault(section, {}) if sub else engine
            target[sub or key] = parse_yaml(value, f"--variant={text}")
    except ValueError:
        raise argparse.ArgumentTypeError(f"--variant={text!r}: expected NAME=KEY=VALUE,... "
                                         "(engine keys)") from None
    if not name:
        raise argparse.ArgumentTypeError(f"--variant={text!r}: the variant needs a name")
    return name, engine


def _data_dir(args: argparse.Namespace, tmp: str) -> Path | None:
    """The folder the loader reads (``--synthetic-data`` writes it into ``tmp`` first, enough
    images for every step in one epoch), or None for the in-memory batches."""
    if args.synthetic_data is not None:
        need = (args.warmup + args.steps + 1) * args.batch
        start = time.perf_counter()
        write_synthetic_dataset(tmp, args.synthetic_data,
                                images_per_class=math.ceil(need / args.synthetic_data))
        print(f"wrote a {args.synthetic_data}-class synthetic set into {tmp} in "
              f"{time.perf_counter() - start:.0f} s")
        return Path(tmp)
    return None if args.data is None else Path(args.data)


def _describe_batches(args: argparse.Namespace, parser: argparse.ArgumentParser,
                      device: torch.device) -> None:
    """Say which batches the trainer rows get; refuse a run with fewer classes than the data."""
    if args.data_dir is None:
        print("batches: 4 synthetic in-memory batches, cycled (pure compute: data ~0 by "
              "construction; --data or --synthetic-data for the real loader)")
        return
    manifest = read_manifest(args.data_dir)
    for classes, _ in args.runs:
        if classes < manifest.num_classes:
            parser.error(f"--runs: {classes} classes, fewer than the "
                         f"{manifest.num_classes} of {args.data_dir / 'manifest.json'}")
    workers = run_config(args, manifest.num_classes, 1.0, device).data.num_workers
    print(f"batches: data_pipeline.make_loader over {args.data_dir} ({manifest.num_samples:,} "
          f"images, {manifest.num_classes:,} classes), workers {workers}, pinned memory "
          f"{'on' if device.type == 'cuda' else 'off'}; each head keeps its --runs class count "
          f"and gets the data's labels in [0, {manifest.num_classes:,}): the step costs what it "
          "costs on data of the head's class count (all rows at r=1, r*C sampled otherwise)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--runs", type=_runs, help="classes:rate,... (CUDA default "
                   "1000:1.0,1000000:1.0,1000000:0.1; CPU default 1000:1.0,20000:1.0,20000:0.1)")
    p.add_argument("--backbone", help="any backbone.name (iresnet*, mobilefacenet, vit_t|s|b|l|h, "
                   "timm:<model>); default iresnet50 on CUDA, iresnet_tiny on CPU")
    p.add_argument("--checkpointing", type=int, default=0, help="backbone.checkpointing: "
                   "every k-th block recomputed in the backward (iresnet*, vit_*; default 0)")
    p.add_argument("--depth", type=int, help="backbone.depth: a ViT's block count (default: "
                   "the architecture's)")
    p.add_argument("--batch", type=int, help="images per step (default 128 CUDA, 8 CPU)")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="default bf16 CUDA, fp32 CPU")
    p.add_argument("--engine", choices=["ddp", "deepspeed"], default="ddp",
                   help="the trainer's backbone engine (deepspeed: ZeRO-1, the schema's default "
                   "stage); the ceiling is always plain torch")
    p.add_argument("--nchw", action="store_true", help="engine.channels_last=false, and the "
                   "ceiling in NCHW too (DeepSpeed holds its parameters NCHW either way)")
    p.add_argument("--compile", action="store_true", help="engine.compile=true, and the "
                   "ceiling's backbone torch.compile'd too")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--data", metavar="DIR", help="batches from the loader over this "
                        "converted folder (shards + manifest.json)")
    source.add_argument("--synthetic-data", type=int, metavar="K", help="batches from the "
                        "loader over a K-class synthetic folder written to a temp dir first")
    p.add_argument("--workers", type=int, help="loader workers (data.num_workers; default: the "
                   "schema's)")
    p.add_argument("--steps", type=int, help="timed steps (default 50 CUDA, 5 CPU)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 10 CUDA, 2 CPU)")
    p.add_argument("--kernel", choices=["auto", "torch", "triton"], default="auto",
                   help="the head's class-tile passes (head.kernel)")
    p.add_argument("--state-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the head's weight, gradient and optimizer state (head.state_dtype)")
    p.add_argument("--model-gpus", type=int, default=8, help="GPU count of the modelled "
                   "communication line (default 8)")
    p.add_argument("--variant", type=_variant, action="append", default=[],
                   metavar="NAME=KEY=VALUE,...", help="each trainer run again with these "
                   "engine.* keys (one_rank_ddp, prefetch, fused_updates, "
                   "zero_settings.overlap_comm, ...), its rows named [NAME]; repeatable")
    p.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    cuda = resolve_device(args.device, 0).type == "cuda"
    defaults = dict(runs=[(1000, 1.0), (1_000_000, 1.0), (1_000_000, 0.1)], backbone="iresnet50",
                    batch=128, precision="bf16", steps=50, warmup=10) if cuda else \
        dict(runs=[(1000, 1.0), (20_000, 1.0), (20_000, 0.1)], backbone="iresnet_tiny",
             batch=8, precision="fp32", steps=5, warmup=2)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for name, keys in args.variant:  # a bad key fails here, before any run
        try:
            run_config(args, 2, 1.0, torch.device("cpu"), keys)
        except ValueError as e:
            p.error(f"--variant {name}: {e}")
    env = init_distributed(args.device)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
            args.data_dir = _data_dir(args, tmp)
            print(f"device {env.device}, {args.backbone}, {args.engine} {args.precision}"
                  f"{' compiled' if args.compile else ''}, head state {args.state_dtype}, "
                  f"batch {args.batch}, "
                  f"{args.steps} steps after {args.warmup}, torch {torch.__version__}")
            _describe_batches(args, p, env.device)
            results = [("ceiling (backbone only)", 0, 1.0, run_ceiling(args, env.device))]
            for classes, rate in args.runs:
                for name, keys in [("", {}), *args.variant]:
                    label = f"trainer {classes:,} r={rate}" + (f" [{name}]" if name else "")
                    results.append((label, classes, rate,
                                    run_step(args, env, classes, rate, keys)))
            print_table(args, results)
            if args.json:
                write_json(args, results, env.device)
    finally:
        shutdown()


if __name__ == "__main__":
    main()
