"""Which backbone engine a run trains fastest with, among those whose memory fits: the
``engine:`` line of ``python -m launch.plan``.

DDP keeps the backbone's whole state (fp32 parameters, gradients, optimizer state) on every
GPU; DeepSpeed's ZeRO shards the optimizer state with its fp32 master weights (stage 1) and
the gradients too (stage 2), and holds bf16/fp16 parameters. What each engine costs in
memory is ``offline.plan.plan``'s; how fast each ran is measured, in ``engine_speeds.json``
beside this file (each run with its date, machine and command, shown in docs/benchmarks.md):
on iresnet50 on an H200, DDP's step ran at 2.0-2.5x DeepSpeed ZeRO-1's (DeepSpeed's backward
takes about 33 ms more, whatever the memory layout). The order is the measured one, never a
guess: a backbone without runs of its own takes the order measured on the reference
backbone, and the line names it and the command that measures it. Within DeepSpeed the
smaller ZeRO stage comes first (less to gather and scatter per step; not measured apart).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path

from offline.plan import GIB, Inputs, plan

SPEEDS = Path(__file__).with_name("engine_speeds.json")
"""Measured images/s per backbone and engine (``runs``), with where and how."""
REFERENCE = "iresnet50"
"""The backbone whose measured order stands for one not measured yet."""
CANDIDATES = (("ddp", 0), ("deepspeed", 1), ("deepspeed", 2))
"""(engine.type, engine.zero_stage) a plan chooses from (DeepSpeed's bf16 needs ZeRO >= 1)."""


@dataclass(frozen=True)
class EngineChoice:
    """The engine :func:`choose_engine` picks and its one line of reasons."""

    engine: str
    zero_stage: int  # 0 with ddp
    fits: bool
    line: str


@functools.cache
def _table() -> dict:
    return json.loads(SPEEDS.read_text())


def measured_speeds() -> dict[str, dict[tuple[str, int], int]]:
    """``{backbone: {(engine, ZeRO stage; 0 for ddp): the best median images/s of its runs}}``
    from :data:`SPEEDS`."""
    out: dict[str, dict[tuple[str, int], int]] = {}
    for run in _table()["runs"]:
        best = out.setdefault(run["backbone"], {})
        key = (run["engine"], run.get("zero_stage", 0))
        best[key] = max(best.get(key, 0), run["images_per_s"])
    return out


def _name(engine: str, zero_stage: int) -> str:
    return "DDP" if engine == "ddp" else f"DeepSpeed ZeRO-{zero_stage}"


def choose_engine(inp: Inputs) -> EngineChoice:
    """The fastest measured engine whose planned peak fits ``inp.gpu_memory`` on ``inp``'s
    GPUs, else the one with the smallest peak; fp16 leaves DDP out (it needs DeepSpeed's
    loss scaler)."""
    speeds = measured_speeds()
    basis = inp.backbone if inp.backbone in speeds else REFERENCE
    rate = speeds[basis]
    ranked = sorted((c for c in CANDIDATES if c[0] != "ddp" or inp.precision != "fp16"),
                    key=lambda c: (-rate.get(c, 0), c[1]))  # unmeasured ones last
    peaks = {c: plan(replace(inp, engine=c[0], zero_stage=c[1])).peak_bytes_per_gpu
             for c in ranked}
    limit = inp.gpu_memory * GIB
    fitting = [c for c in ranked if peaks[c] <= limit]
    chosen = fitting[0] if fitting else min(ranked, key=peaks.__getitem__)
    name, gib = _name(*chosen), peaks[chosen] / GIB
    if not fitting:
        why = f"none fits in {inp.gpu_memory:g} GiB per GPU; {name} needs the least, {gib:.1f}"
    elif chosen != ranked[0]:
        first = ranked[0]
        why = (f"{_name(*first)} needs {peaks[first] / GIB:.1f} GiB per GPU, over "
               f"{inp.gpu_memory:g}; {name} fits in {gib:.1f}")
    else:
        why = f"fits in {gib:.1f} of {inp.gpu_memory:g} GiB per GPU"
    if inp.precision == "fp16":
        why += " (fp16 needs DeepSpeed's loss scaler)"
    measured = ", ".join(f"{_name(*c)} {v:,}" for c, v in sorted(rate.items(),
                                                                  key=lambda kv: -kv[1]))
    table = _table()
    basis_words = (f"{basis}" if basis == inp.backbone else
                   f"{basis} ({inp.backbone} not measured: python bench/train.py --backbone "
                   f"{inp.backbone} [--engine deepspeed] on the GPU)")
    keys = ("engine.type=ddp" if chosen[0] == "ddp" else
            f"engine.type=deepspeed engine.zero_stage={chosen[1]}")
    line = (f"engine: {name} ({keys}): {why}; measured img/s on {basis_words}, "
            f"{table['device']} {table['measured']}: {measured}")
    asked = (inp.engine, 0 if inp.engine == "ddp" else inp.zero_stage)
    if asked != chosen:
        line += f"; the recipe asks for {_name(*asked)}"
    return EngineChoice(chosen[0], chosen[1], bool(fitting), line)
