"""A train.global_batch run keeps its recipe across world sizes: cut on P ranks and resumed on
P' (forked gloo ranks, the in-process trainer), its losses, lr and dynamic AdaCos scale (whose
statistics are taken over the whole step, trainer.engine.step_statistics) step by step equal
the unbroken run's, and every metrics row says the world size and accumulation it ran with."""

from __future__ import annotations

import json

import torch
from launch_helpers import ROOT
from spawn import run_ranks

STEPS = 6
# A small lr: summation-order differences grow over steps, faster at a large one (PReLU's kink
# turns a rounding difference into a gradient jump): 1e-7 over 6 steps here, 1e-4 at lr 0.1.
RECIPE = ["engine.type=ddp", "train.batch_size=4", "train.global_batch=16", "data.num_workers=0",
          "optim.lr=0.001", "margin.type=adacos", "margin.adacos=dynamic", "margin.s=null",
          f"train.max_steps={STEPS}", "checkpoint.every=2", "log.every=1",
          "log.progress=false", "log.hist_every=0", "log.wandb=disabled"]


class _Cut(RuntimeError):
    """Raised on every rank inside a step: the run ends with its last checkpoint."""


def _train(rank: int, world: int, data: str, run: str, cut_after: int | None,
           extra: tuple[str, ...] = ()) -> int:
    """Train (or resume) ``run`` on this rank; with ``cut_after``, raise in the first
    forward after that many steps of this process. Returns this process's forwards."""
    from trainer import seams
    from trainer.config import load_config
    from trainer.dist import DistEnv
    from trainer.loop import train

    cfg = load_config(ROOT / "configs" / "smoke.yaml",
                      [f"data.dir={data}", f"output={run}", *RECIPE, *extra])
    forwards = []
    k = 4 // world

    def cut(loss, rank):
        forwards.append(1)
        if cut_after is not None and len(forwards) > cut_after * k:
            raise _Cut(f"cut after {cut_after} steps")

    seams.HEAD_LOSS.hooks = (cut,)
    try:
        train(cfg, DistEnv(rank, world, 0, torch.device("cpu")))
    except _Cut:
        pass
    return len(forwards)


def _rows(run) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if "loss" in row]


def test_a_run_cut_on_2_ranks_resumes_on_4_then_on_1_with_the_unbroken_losses(
        tmp_path, synthetic_data):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_ranks(_train, 1, args=(str(synthetic_data), str(whole), None), timeout=300)
    run_ranks(_train, 2, args=(str(synthetic_data), str(cut), 2), timeout=300)
    run_ranks(_train, 4, args=(str(synthetic_data), str(cut), 2), timeout=300)
    run_ranks(_train, 1, args=(str(synthetic_data), str(cut), None), timeout=300)
    expected, got = _rows(whole), _rows(cut)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [(r["world_size"], r["accumulation"]) for r in got] == \
        [(2, 2)] * 2 + [(4, 1)] * 2 + [(1, 4)] * 2
    assert {(r["world_size"], r["accumulation"]) for r in expected} == {(1, 4)}
    for a, b in zip(got, expected, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a, b)
        assert a["lr"] == b["lr"]
        # the step's statistics, whatever its passes; a median is one sample's angle, so it
        # carries the rounding of that one sample (1.5e-5 at step 6 here)
        for key, tolerance in (("scale", 1e-5), ("b_avg", 1e-5), ("theta_med", 1e-4)):
            assert abs(a[key] - b[key]) <= tolerance * abs(b[key]), (key, a["step"], a, b)
