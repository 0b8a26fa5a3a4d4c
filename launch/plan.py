"""``python -m launch.plan``: does my run fit, and what does each step move?

Per-GPU memory of the sharded head (weight, optimizer state, gradient, working memory) and
of the backbone (parameters, gradients, optimizer state after ZeRO sharding, activations),
the bytes and time of every collective of one step, and the largest class count that fits,
all from ``partial_fc.memory`` (the formulas, with their derivation), and the backbone engine
to train with: the fastest measured whose memory fits (``offline.plan_engine``, one line
saying why). ``--config RECIPE``
supplies the run's values; flags override them. ``--scaling 8,64,512`` adds a modelled step
time per GPU count (see docs/scaling.md for which inputs are measured and which modelled).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict

from launch.cli import EXIT_STATUS, plain_help
from offline.plan import (
    GIB,
    PlanError,
    PlanResult,
    StepTime,
    accumulated_step,
    plan,
    step_model,
)
from offline.plan_engine import choose_engine
from offline.plan_inputs import MACHINE, resolve_inputs
from partial_fc.backbones import list_backbones
from trainer.config.accumulation import splits


def build_parser() -> argparse.ArgumentParser:
    m = MACHINE
    p = argparse.ArgumentParser(
        prog="python -m launch.plan", description=plain_help(__doc__.split("\n\n")[0]),
        epilog="Values not given come from --config, else from trainer.config's schema defaults "
        f"(launch.train --help lists them). {EXIT_STATUS}.")
    p.add_argument("--config", help="a recipe (configs/*.yaml) supplying the values below; "
                   "its data folder need not exist")
    p.add_argument("--classes", type=int, help="identities C (default: the recipe's "
                   "data.num_classes)")
    p.add_argument("--gpus", type=int, help="GPUs in all (default: nodes x gpus-per-node)")
    p.add_argument("--nodes", type=int, help="nodes (default 1, or --gpus / --gpus-per-node)")
    p.add_argument("--gpus-per-node", type=int, default=m["gpus_per_node"],
                   help=f"GPUs per node (default {m['gpus_per_node']})")
    p.add_argument("--sample-rate", type=float,
                   help="Partial FC sample rate r in [0, 1] (0: the batch's own classes only)")
    p.add_argument("--dim", type=int, help="embedding size D")
    p.add_argument("--batch", type=int, help="images per GPU (per micro-batch with "
                   "--global-batch)")
    p.add_argument("--global-batch", type=int, help="images per optimisation step, all GPUs "
                   "(default: the recipe's train.global_batch)")
    p.add_argument("--world-sizes", action="store_true", help="the GPU counts a "
                   "--global-batch step runs on exactly, with the passes, memory and "
                   "modelled H100 step time at each")
    p.add_argument("--backbone", help=f"one of {', '.join(list_backbones())}")
    p.add_argument("--checkpointing", type=int, help="activation checkpointing of every k-th "
                   "block (ViTs; 0 = off)")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], help="sgd = with momentum")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="backbone compute")
    p.add_argument("--engine", choices=["ddp", "deepspeed"], help="backbone replication")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2], help="deepspeed ZeRO stage")
    p.add_argument("--max-tile-mib", type=int, help="the head's budget for one fp32 [N, chunk] "
                   "tile of the class-chunked torch path")
    p.add_argument("--max-update-mib", type=int, help="the head optimizer's budget for the fp32 "
                   "temporaries of one chunk of updated rows")
    p.add_argument("--state-dtype", choices=["fp32", "bf16"],
                   help="dtype of head weight, gradient and optimizer state")
    p.add_argument("--subcenters", type=int, help="sub-center ArcFace: K weight rows per "
                   "class (K x the head's weight, state, gradient and matmuls)")
    p.add_argument("--row-sparse-grad", action=argparse.BooleanOptionalAction,
                   default=m["row_sparse_grad"], help="the head's weight gradient holds "
                   "only the sampled rows, as PartialFC keeps it (default); "
                   "--no-row-sparse-grad models a dense one")
    p.add_argument("--gpu-memory", type=float, default=m["gpu_memory"],
                   help=f"GiB per GPU (default {m['gpu_memory']:g})")
    p.add_argument("--reserve", type=float, default=m["reserve"], help="GiB per GPU kept for "
                   "the CUDA context, library workspaces and fragmentation "
                   f"(default {m['reserve']:g})")
    p.add_argument("--intra-bw", type=float, default=m["intra_bw"], help="GB/s per GPU within "
                   f"a node (default {m['intra_bw']:g}, NVLink 4)")
    p.add_argument("--inter-bw", type=float, default=m["inter_bw"], help="GB/s per GPU between "
                   f"nodes (default {m['inter_bw']:g} = 400 Gb/s)")
    p.add_argument("--latency-us", type=float, default=m["latency_us"], help="per-hop latency, us")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--scaling", help="comma-separated GPU counts: modelled H100 step time each")
    p.add_argument("--head-factor", type=float, default=2.0, help="--scaling: head time as a "
                   "multiple of its matmuls (default 2: the fused head's design target)")
    return p


def _gib(n: float) -> str:
    return f"{n / GIB:8.2f} GiB"


def format_table(r: PlanResult) -> str:
    i = r.inputs
    lines = [
        f"{i.classes:,} classes on {i.gpus} GPU{'s' * (i.gpus > 1)} ({i.gpus_per_node}/node): "
        f"{r.classes_per_gpu:,} per GPU, {r.sampled_classes_per_gpu:,} sampled (r="
        f"{i.sample_rate})"
        + (f", {i.subcenters} sub-centers each" if i.subcenters > 1 else "")
        + f"; D={i.dim}, batch {i.batch}/GPU; {i.backbone} "
        f"({r.backbone_params / 1e6:.1f}M params"
        + (f", checkpointing every {i.checkpointing}" if i.checkpointing else "")
        + f"), {i.engine} {i.precision}"
        + (f" ZeRO-{i.zero_stage}" if i.engine == "deepspeed" else "")
        + f", {i.optimizer}, head state {i.state_dtype}",
        "",
        "memory per GPU",
    ]
    rows = [("head weight", r.weight_bytes_per_gpu),
            ("head optimizer state", r.head_state_bytes_per_gpu),
            ("head gradient" + (" (sampled rows)" if i.row_sparse_grad else " (dense)"),
             r.head_grad_bytes_per_gpu),
            ("head logits / working", r.head_working_bytes_per_gpu),
            ("backbone parameters", r.backbone_param_bytes_per_gpu),
            ("backbone gradients", r.backbone_grad_bytes_per_gpu),
            ("backbone optimizer state", r.backbone_state_bytes_per_gpu),
            ("activations", r.activation_bytes_per_gpu),
            ("reserve (context, workspaces)", r.reserve_bytes_per_gpu),
            ("peak", r.peak_bytes_per_gpu)]
    lines += [f"  {name:<34}{_gib(value)}" for name, value in rows]
    verdict = "fits" if r.fits else "does NOT fit"
    lines += [f"  {verdict} in {_gib(r.gpu_memory_bytes).strip()}; largest class count "
              f"that fits: {r.max_classes:,}", "",
              f"collectives per step ({r.link} link, {r.link_bytes_per_s / 1e9:g} GB/s "
              "per GPU, ring)"]
    for c in r.collectives:
        lines.append(f"  {c.name:<38}{c.kind:<15}{c.bytes / 2**20:10.2f} MiB"
                     f"{c.seconds * 1e3:9.3f} ms")
    lines.append(f"  {'total':<53}{r.comm_seconds * 1e3:19.3f} ms")
    if i.global_batch:
        n = i.global_batch // i.batch
        sizes = ", ".join(map(str, splits(n)))
        split = (f"{n // i.gpus} pass(es) of this batch per step on {i.gpus} GPUs" if
                 n % i.gpus == 0 else f"{i.gpus} GPUs cannot split it")
        lines += ["", f"train.global_batch={i.global_batch}: {n} micro-batches of {i.batch}, "
                  f"{split}; exact on {sizes} GPUs (--world-sizes)"]
    lines += ["", f"loader: {r.loader_images_per_s_per_gpu:,.0f} img/s per GPU (H100 step) "
              f"needs {r.loader_workers_per_gpu:.2f} decoding cores per GPU, "
              f"{r.loader_workers_per_node} per node of {i.gpus_per_node} (data.num_workers"
              f"={math.ceil(r.loader_workers_per_gpu)} per rank)"]
    return "\n".join(lines)


def format_scaling(rows: list[tuple[PlanResult, StepTime]]) -> str:
    out = ["| GPUs | classes/GPU | sampled/GPU | peak GiB | fits | backbone ms | head ms | "
           "head comm ms | grad sync ms | step ms | img/s | efficiency |",
           "| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r, m in rows:
        out.append(
            f"| {r.inputs.gpus} | {r.classes_per_gpu:,} | {r.sampled_classes_per_gpu:,} | "
            f"{r.peak_bytes_per_gpu / GIB:.1f} | {'yes' if r.fits else 'no'} | "
            f"{m.backbone_s * 1e3:.1f} | {m.head_s * 1e3:.2f} | {m.head_comm_s * 1e3:.2f} | "
            f"{m.grad_sync_exposed_s * 1e3:.2f} | {m.step_s * 1e3:.1f} | "
            f"{m.images_per_s:,.0f} | {m.efficiency:.0%} |")
    return "\n".join(out)


def world_size_rows(config: str | None, given: dict, head_factor: float
                    ) -> list[tuple[PlanResult, int, StepTime]]:
    """Per world size the recipe's ``train.global_batch`` step splits into exactly (the
    divisors of its micro-batches, trainer.config.accumulation): the plan at that many GPUs,
    the passes per step and the modelled step."""
    inp = resolve_inputs(config, given, gpus=1)
    if inp.global_batch is None:
        raise PlanError("--world-sizes: needs --global-batch or a recipe with "
                        "train.global_batch")
    n = inp.global_batch // inp.batch
    rows = []
    for gpus in splits(n):
        if gpus > inp.classes:
            break
        r = plan(resolve_inputs(config, given, gpus=gpus))
        step = accumulated_step(step_model(r, head_factor), inp.batch, gpus, n // gpus,
                                inp.statistics_pass)
        rows.append((r, n // gpus, step))
    return rows


def format_world_sizes(rows: list[tuple[PlanResult, int, StepTime]]) -> str:
    i = rows[0][0].inputs
    out = [f"train.global_batch={i.global_batch}: {i.global_batch // i.batch} micro-batches "
           f"of {i.batch}" + (" (the head's statistics: one more forward without grad per "
                              "micro-batch where passes > 1)" if i.statistics_pass else ""),
           "", "| GPUs | passes | peak GiB | fits | step ms | img/s |",
           "| ---: | ---: | ---: | --- | ---: | ---: |"]
    out += [f"| {r.inputs.gpus} | {k} | {r.peak_bytes_per_gpu / GIB:.1f} | "
            f"{'yes' if r.fits else 'no'} | {m.step_s * 1e3:.1f} | {m.images_per_s:,.0f} |"
            for r, k, m in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.world_sizes:
            rows = world_size_rows(args.config, vars(args), args.head_factor)
            print(json.dumps([{**asdict(r), "passes": k, "step": asdict(m)}
                              for r, k, m in rows], indent=1)
                  if args.json else format_world_sizes(rows))
            return 0
        if args.scaling:
            counts = [int(x) for x in args.scaling.split(",") if x.strip()]
            if not counts or min(counts) < 1:
                raise PlanError(f"--scaling={args.scaling!r}: comma-separated GPU counts >= 1")
            rows = []
            for g in counts:
                r = plan(resolve_inputs(args.config, vars(args), gpus=g))
                rows.append((r, step_model(r, args.head_factor)))
            print(json.dumps([{**asdict(r), "step": asdict(m)} for r, m in rows], indent=1)
                  if args.json else format_scaling(rows))
            return 0
        result = plan(resolve_inputs(args.config, vars(args)))
        choice = choose_engine(result.inputs)
    except (PlanError, ValueError) as e:
        print(f"launch.plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps({**asdict(result), "engine_choice": asdict(choice)}, indent=1) if args.json
          else f"{format_table(result)}\n\n{choice.line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
