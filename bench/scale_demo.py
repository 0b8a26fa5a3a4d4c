"""The synthetic-scale demonstration: the scale's dynamics at many classes.

    python bench/scale_demo.py [--classes N] [--steps N] [--batch N] [--backbone NAME]
                               [--device cpu|cuda] [--nproc N] [--jobs N] [--runs a,b]
                               [--png DIR] [--dpi N] [--work DIR] [key=value ...]
    make demo-scale [CLASSES=...] [STEPS=...] [BATCH=...] [BACKBONE=...] [DEVICE=...]

Trains ``configs/scale_demo.yaml`` (1M identities of ``data.source=synthetic``: no data
folder) once per entry of ``RUNS`` with ``launch.train`` (a fresh process each, so every run
starts with a free device; ``torchrun`` with ``--nproc`` > 1), then draws
``python -m launch.report`` over them: ``WORK/report.html`` and the figures as PNGs in
``--png``. The sizes default to the recipe's (sized for one H100, see its comment); the
flags override them, trailing ``key=value`` arguments go to every run. ``--device cpu``
also trains in fp32 (the recipe's bf16 autocast is slow on a CPU). ``--jobs`` runs that many
trainings at once (a CPU machine's cores split evenly between them). Each run resumes when
its folder already holds a checkpoint (rerunning the command finishes an interrupted demo);
``--fresh`` starts over. Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "scale_demo.yaml"

# run name -> overrides of configs/scale_demo.yaml (which sets head.sample_rate=0.1).
RUNS: dict[str, tuple[str, ...]] = {
    "arcface_r0.1": ("margin.type=arcface", "margin.s=64.0", "margin.m=0.5"),
    "adacos_fixed_r0.1": ("margin.type=adacos", "margin.adacos=fixed"),
    "adacos_dynamic_r0.1": ("margin.type=adacos", "margin.adacos=dynamic"),
    "adacos_dynamic_r1": ("margin.type=adacos", "margin.adacos=dynamic", "head.sample_rate=1.0"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/scale_demo.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", type=int, help="data.num_classes (recipe: 1,000,000)")
    p.add_argument("--images", type=int, help="data.synthetic_images_per_class (default: 4)")
    p.add_argument("--steps", type=int, help="train.max_steps per run (recipe: 3,000)")
    p.add_argument("--batch", type=int, help="train.batch_size per rank (recipe: 512)")
    p.add_argument("--backbone", help="backbone.name (recipe: mobilefacenet)")
    p.add_argument("--embedding", type=int, help="backbone.embedding_size (default: 512)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="device (default: auto)")
    p.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun when > 1)")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at the same time")
    p.add_argument("--runs", default=",".join(RUNS),
                   help=f"comma-separated subset of {', '.join(RUNS)}")
    p.add_argument("--work", default="runs/scale_demo", help="folder of the run folders")
    p.add_argument("--png", default="docs/synthetic_scale_demo_1m",
                   help="where the report's PNGs go")
    p.add_argument("--dpi", type=int, default=65, help="PNG resolution")
    p.add_argument("--fresh", action="store_true", help="start every run over")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="for every run")
    args = p.parse_args(argv)
    args.work, args.png = Path(args.work).resolve(), Path(args.png).resolve()
    unknown = set(args.runs.split(",")) - set(RUNS)
    if unknown:
        p.error(f"--runs: unknown {', '.join(sorted(unknown))} (valid: {', '.join(RUNS)})")
    return args


def run_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides every run gets from the flags (unset flags: the recipe's values)."""
    flags = {"data.num_classes": args.classes, "data.synthetic_images_per_class": args.images,
             "train.max_steps": args.steps, "train.batch_size": args.batch,
             "backbone.name": args.backbone, "backbone.embedding_size": args.embedding,
             "device": args.device}
    out = [f"{key}={value}" for key, value in flags.items() if value is not None]
    if args.device == "cpu":
        out.append("engine.precision=fp32")
    if args.fresh:
        out.append("checkpoint.resume=none")
    return out + list(args.overrides)


def command(args: argparse.Namespace, name: str) -> list[str]:
    """The training command of run ``name``."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node", str(args.nproc)] if args.nproc > 1 else [sys.executable])
    return [*launcher, "-m", "launch.train", "--config", str(CONFIG), f"name={name}",
            f"output={args.work / name}", "log.progress=false", *RUNS[name],
            *run_overrides(args)]


def train_all(args: argparse.Namespace, names: list[str]) -> None:
    """Run the trainings, ``--jobs`` at a time; each one's output goes to WORK/<name>.out."""
    env = dict(os.environ)
    if args.jobs > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (args.jobs * args.nproc)))
    args.work.mkdir(parents=True, exist_ok=True)
    waiting, running = list(names), []
    while waiting or running:
        while waiting and len(running) < args.jobs:
            name = waiting.pop(0)
            cmd = command(args, name)
            log = open(args.work / f"{name}.out", "w")  # noqa: SIM115 - closed below
            print(f"start {name}: {' '.join(cmd[1:])}", flush=True)
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            running.append((name, proc, log, time.monotonic()))
        time.sleep(0.5)
        for item in [r for r in running if r[1].poll() is not None]:
            name, proc, log, started = item
            log.close()
            running.remove(item)
            tail = (args.work / f"{name}.out").read_text().strip().splitlines()[-1:]
            print(f"done  {name} in {time.monotonic() - started:.0f} s: "
                  f"{tail[0] if tail else ''}", flush=True)
            if proc.returncode != 0:
                for _, other, _, _ in running:
                    other.terminate()
                sys.exit(f"{name} failed (exit {proc.returncode}); see "
                         f"{args.work / f'{name}.out'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = args.runs.split(",")
    started = time.monotonic()
    train_all(args, names)
    report = [sys.executable, "-m", "launch.report",
              *[str(args.work / n) for n in names],
              "--out", str(args.work / "report.html"), "--png", str(args.png),
              "--dpi", str(args.dpi)]
    subprocess.run(report, cwd=ROOT, check=True)
    print(f"scale demo: {len(names)} runs in {time.monotonic() - started:.0f} s; report "
          f"{args.work / 'report.html'}, PNGs in {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
