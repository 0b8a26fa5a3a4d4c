"""The GPU pace stage's own measurements (bench/gpu_session.sh pace), one subcommand each.

    python3 bench/pace.py tune --table partial_fc/tiles/tuned.json --out $OUT/tuned.json \
        --report LOGS/tune.json          # the sweep: winners per shape bucket for this card
    python3 bench/pace.py profile-head --out DIR   # torch.profiler of the head's step
    python3 bench/pace.py profile-train --out DIR  # ... of the trainer's step (bench/train.py)
    python3 bench/pace.py profile-train --engine deepspeed --out DIR   # ... DeepSpeed's step
    python3 bench/pace.py largest --json LOGS/largest.json   # the largest C_local that trains
    python3 bench/pace.py filtered --json LOGS/filtered.json # the filtered backward, timed

- ``tune``: every candidate of ``partial_fc.tiles.tuning`` on the shapes users run (``N`` 512,
  1024, 2048; ``S = C_local r`` for ``C_local`` 100k, 1M, 4M and ``r`` 1, 0.1; ``D`` 512;
  bf16 ``e``; fp32 and bf16 state), through the same measurement as a first use
  (``partial_fc.tiles.autotune.measure``: checked against the reference, then timed on at
  most ``--columns`` classes, 262,144 by default, four times what a first use takes: the
  buckets past that share one measurement). The
  table at ``--table`` with this card's entry replaced goes to ``--out``; every trial
  (time, difference, error) to ``--report``; the winners to this user's cache too, so that
  the stage's later steps run them (``partial_fc.tiles.tuning.cache_path``).
- ``profile-head``: ``PartialFC`` forward and backward at ``-C``/``-N``/``-r``, bf16 autocast,
  one process: a Chrome trace (``head-trace.json.gz``) and the per-kernel table
  (``head-kernels.txt``, CUDA time first).
- ``profile-train``: bench/train.py's ceiling and trainer steps (iresnet50 bf16 batch 128, 1k
  classes) under the profiler: ``train-trace.json.gz`` and ``train-kernels.txt``; with
  ``--engine deepspeed`` (and ``--variant``s, passed on) ``train-deepspeed-trace.json.gz``...,
  where ZeRO-1's extra backward shows.
- ``largest``: the largest ``C_local`` that trains one step (iresnet50 bf16 batch 128, r=0.1,
  bf16 head state) on this card, found by trying ``launch.plan``'s prediction for the card's
  memory and then bisecting (each try in a fresh process, so an out-of-memory leaves nothing
  behind), beside that prediction.
- ``filtered``: the kernels' backward (``class_tile_grads``, the configuration the tuner
  chose) exact and filtered (``partial_fc.tiles.filtered``) at ``-C``/``-N``, D 512, bf16
  ``e``, fp32 rows, s = 64, on a flat softmax (random rows, as at initialisation) and on a
  separated one (rows and samples in 8 clusters, the batch sorted by cluster: the most a tile
  can be skipped); per softmax: median ms of each, the share of tiles skipped, and the
  filtered path's difference from the exact one against the bound (``u m_i`` per row).

Prints figures, asserts nothing; not run by the test suite.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

NS = (512, 1024, 2048)
SAMPLED = (10_000, 100_000, 400_000, 1_000_000, 4_000_000)  # C_local r
STATES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROOT = Path(__file__).resolve().parents[1]


def tune(args: argparse.Namespace) -> None:
    from partial_fc.tiles import autotune, tuning

    device = torch.device(args.device)
    info = tuning.device_info(device)
    buckets, trials, measured = {}, [], {}
    for state, dtype in STATES.items():
        for n in NS:
            for s in SAMPLED:
                cols = min(s, args.columns)
                key = (n, cols, state)
                if key not in measured:
                    g = torch.Generator(device=device).manual_seed(0)
                    e = torch.nn.functional.normalize(
                        torch.randn(n, 512, device=device, generator=g), dim=1).bfloat16()
                    w = (torch.randn(cols, 512, device=device, generator=g) * 0.05).to(dtype)
                    t0 = time.perf_counter()
                    measured[key] = autotune.measure(e, w, info, columns=cols)
                    print(f"N={n} S={cols} state={state}: {len(measured[key])} candidates in "
                          f"{time.perf_counter() - t0:.1f} s", flush=True)
                shape = tuning.Shape.of(n, s, 512, torch.bfloat16, dtype)
                timed = [t for t in measured[key] if t.ms is not None]
                for t in measured[key]:
                    trials.append({"bucket": shape.key, "measured_columns": cols,
                                   **t.choice.to_json(), "ms": t.ms,
                                   "difference": t.difference, "error": t.error})
                if timed:
                    best = min(timed, key=lambda t: t.ms)
                    buckets[shape.key] = best.choice.to_json()
                    tuning.remember(info, shape, best.choice, tuning.cache_path())
                    print(f"  {shape.key}: {autotune.describe(best.choice)}, {best.ms:.3f} ms "
                          f"(default {timed[0].ms:.3f} ms)", flush=True)
    table = json.loads(args.table.read_text())
    table["devices"][info.name] = {
        "measured": {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                     "triton": _version("triton"), "sms": info.sms,
                     "capability": list(info.capability),
                     "command": "bash bench/gpu_session.sh pace (bench/pace.py tune)"},
        "buckets": buckets}
    args.out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    args.report.write_text(json.dumps({"device": info.name, "trials": trials}, indent=1) + "\n")


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


def _profiled(run, out: Path, name: str) -> None:
    """``run()`` under torch.profiler: ``out/<name>-trace.json.gz`` and the per-kernel table
    ``out/<name>-kernels.txt`` (CUDA time first)."""
    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    with profile(activities=[ProfilerActivity.CPU, *cuda]) as prof:
        run()
    trace = out / f"{name}-trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total",
                                      row_limit=60)
    (out / f"{name}-kernels.txt").write_text(table + "\n")
    print(table)


def profile_head(args: argparse.Namespace) -> None:
    from partial_fc import PartialFC, build_margin

    device = torch.device(args.device)
    head = PartialFC(512, args.classes, build_margin(dict(type="arcface")),
                     sample_rate=args.sample_rate, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    emb = torch.randn(args.batch, 512, device=device, generator=g)
    labels = torch.randint(0, args.classes, (args.batch,), device=device, generator=g)

    def steps(count: int) -> None:
        for _ in range(count):
            x = emb.detach().requires_grad_()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = head(x, labels)
            loss.backward()
            head.weight.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()

    steps(3)  # compile, tune, first-use check
    print("\n".join(head.take_notes()))
    _profiled(lambda: steps(args.steps), args.out, "head")


def profile_train(args: argparse.Namespace) -> None:
    """bench/train.py under the profiler with ``--engine`` and each ``--variant`` passed on;
    the files are named after them (``train``, ``train-deepspeed``, ``train-deepspeed-NAME``)
    so that traces of several engines or settings sit side by side in ``--out``."""
    sys.path.insert(0, str(ROOT / "bench"))
    import train  # bench/train.py

    flags = ["--runs", "1000:1.0", "--steps", str(args.steps), "--warmup", "1",
             "--engine", args.engine, *(f"--variant={v}" for v in args.variant)]
    name = "-".join(["train", *([args.engine] if args.engine != "ddp" else []),
                     *(v.split("=", 1)[0] for v in args.variant)])
    _profiled(lambda: train.main(flags), args.out, name)


def _fits(classes: int) -> bool:
    """One trainer step at ``classes`` in a fresh process (bench/train.py, one step)."""
    cmd = [sys.executable, str(ROOT / "bench" / "train.py"), "--runs", f"{classes}:0.1",
           "--steps", "1", "--warmup", "1", "--state-dtype", "bf16"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return done.returncode == 0


def largest(args: argparse.Namespace) -> None:
    from offline import plan
    from offline.plan_inputs import resolve_inputs

    memory_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    given = {"gpus": 1, "batch": 128, "backbone": "iresnet50", "precision": "bf16",
             "engine": "ddp", "sample_rate": 0.1, "state_dtype": "bf16", "reserve": 0.0,
             "gpu_memory": memory_gb, "classes": 1_000_000}
    predicted = plan.plan(resolve_inputs(None, given)).max_classes
    tries, low, high = [], 0, None
    candidate = predicted
    for _ in range(args.tries):
        ok = _fits(candidate)
        tries.append({"classes": candidate, "trains": ok})
        print(f"C_local={candidate:,}: {'trains' if ok else 'does not train'}", flush=True)
        if ok:
            low = candidate
            candidate = candidate * 9 // 8 if high is None else (low + high) // 2
        else:
            high = candidate
            candidate = (low + high) // 2 if low else candidate * 3 // 4
        # after every try: a step stopped at its time limit keeps what was found
        args.json.write_text(json.dumps({"largest_trained": low or None, "first_failed": high,
                                         "planned": predicted, "gpu_memory_gib": memory_gb,
                                         "tries": tries}, indent=1) + "\n")
        if high is not None and high - low <= high // 50:
            break


def _softmax_step(n: int, classes: int, separated: bool, device: torch.device):
    """A one-rank plain softmax step (s = 64) and the backward's inputs (module docstring)."""
    import torch.nn.functional as F

    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(classes, 512, device=device, generator=g)
    labels = torch.randint(0, classes, (n,), device=device, generator=g)
    if separated:
        centres = torch.linalg.qr(torch.randn(512, 8, device=device, generator=g))[0].T
        w = centres[torch.arange(classes, device=device) * 8 // classes] + 0.3 * w / 512**0.5
        labels = labels.sort().values  # the batch in cluster order: whole row blocks skip
    e = F.normalize(w[labels] + 0.3 * torch.randn(n, 512, device=device, generator=g)
                    / 512**0.5, dim=1) if separated else torch.randn(n, 512, device=device)
    e, w = F.normalize(e, dim=1).bfloat16(), (0.05 * w).float()
    inv = 1.0 / w.norm(dim=1)
    logits = torch.cat([64.0 * (e @ w[k:k + 65536].bfloat16().t()).float() * inv[k:k + 65536]
                        for k in range(0, classes, 65536)], dim=1)
    lse = torch.logsumexp(logits, dim=1)
    log_p = logits.gather(1, labels[:, None])[:, 0] - lse
    del logits
    coef = torch.full((n,), 64.0 / n, device=device)
    return (e, w, inv, labels, 64.0, lse, coef, (log_p.exp() - 1) * coef), log_p


def _filtered_run(step: tuple, log_p: torch.Tensor, classes: int) -> dict:
    """The exact and the filtered backward of ``step`` (:func:`_softmax_step`): their times,
    the share of tiles skipped, the difference against the bound."""
    from partial_fc.tiles import autotune
    from partial_fc.tiles import triton as tm
    from partial_fc.tiles.filtered import Skip, skip_bounds, unit_roundoff

    e, w, coef = step[0], step[1], step[6]
    tiles = autotune.TUNER.tiles(e, w) or tm.default_tiles(e)
    tiles = tiles if tiles.engine == "triton" else tm.default_tiles(e)  # Triton GEMMs skip
    skip = Skip(skip_bounds(coef, log_p, classes), torch.zeros(2, dtype=torch.int64,
                                                               device=e.device))
    exact = tm.class_tile_grads(*step, tiles=tiles)
    cut = tm.class_tile_grads(*step, tiles=tiles, skip=skip)
    bound = unit_roundoff(torch.bfloat16) * coef * -torch.expm1(log_p)
    return {"tiles_skipped": skip.tiles[0].item() / skip.tiles[1].item(),
            "grad_e_over_bound": ((cut[0] - exact[0]).norm(dim=1) / bound).max().item(),
            "grad_w_max_abs_diff": (cut[1] - exact[1]).abs().max().item(),
            "exact_ms": autotune._timed(lambda: tm.class_tile_grads(*step, tiles=tiles),
                                        e.device),
            "filtered_ms": autotune._timed(lambda: tm.class_tile_grads(
                *step, tiles=tiles, skip=Skip(skip.below)), e.device)}


def filtered(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    report = {"classes": args.classes, "batch": args.batch, "runs": []}
    for name in ("flat", "separated"):
        step, log_p = _softmax_step(args.batch, args.classes, name == "separated", device)
        run = {"softmax": name, **_filtered_run(step, log_p, args.classes)}
        report["runs"].append(run)
        print(json.dumps(run), flush=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("tune", help="the sweep: this card's winners into the table")
    t.add_argument("--table", type=Path, default=ROOT / "partial_fc" / "tiles" / "tuned.json")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--report", type=Path, required=True)
    t.add_argument("--columns", type=int, default=1 << 18, help="classes a shape is timed on")
    t.add_argument("--device", default="cuda", help="cuda; cpu with TRITON_INTERPRET=1 to try "
                   "the sweep's plumbing (timings meaningless)")
    h = sub.add_parser("profile-head", help="torch.profiler of the head's step")
    h.add_argument("-C", "--classes", type=int, default=1_000_000)
    h.add_argument("-N", "--batch", type=int, default=1024)
    h.add_argument("-r", "--sample-rate", type=float, default=1.0)
    h.add_argument("--steps", type=int, default=5)
    h.add_argument("--device", default="cuda")
    h.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("profile-train", help="torch.profiler of the trainer's step")
    r.add_argument("--steps", type=int, default=5)
    r.add_argument("--engine", choices=["ddp", "deepspeed"], default="ddp",
                   help="bench/train.py's --engine (deepspeed: trace ZeRO-1's backward)")
    r.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                   help="bench/train.py's --variant (engine.* keys), repeatable")
    r.add_argument("--out", type=Path, required=True)
    g = sub.add_parser("largest", help="the largest C_local that trains, beside the plan")
    g.add_argument("--tries", type=int, default=5)
    g.add_argument("--json", type=Path, required=True)
    f = sub.add_parser("filtered", help="the kernels' filtered backward beside the exact one")
    f.add_argument("-C", "--classes", type=int, default=1_000_000)
    f.add_argument("-N", "--batch", type=int, default=1024)
    f.add_argument("--device", default="cuda", help="cuda; cpu with TRITON_INTERPRET=1 to try "
                   "the plumbing at small sizes (timings meaningless)")
    f.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    {"tune": tune, "profile-head": profile_head, "profile-train": profile_train,
     "largest": largest, "filtered": filtered}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
