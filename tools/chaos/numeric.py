"""``make chaos`` rows whose fault is a number: a learning rate that diverges, a NaN loss on
one rank, scales no run can use (listed in ``tools/chaos/cases.py``)."""

from __future__ import annotations

from pathlib import Path

from tools.testbed.harness import STEPS, train


def _finite_checkpoints(run: Path) -> bool:
    import torch

    for folder in (run / "checkpoints").glob("step-*"):
        state = torch.load(folder / "backbone.pt", weights_only=True)
        if not all(bool(v.isfinite().all()) for v in state.values() if v.is_floating_point()):
            return False
    return True


def diverging_lr(data: Path, work: Path) -> tuple[str, bool]:
    r = train(data, work / "run", "optim.lr=1e30", "train.max_bad_steps=3")
    errors = r.errors()
    nulls = sum(1 for rec in r.records() if "loss" in rec and rec["loss"] is None)
    holds = (r.rc == 1 and len(errors) == 1 and "3 steps in a row" in errors[0]
             and nulls == 3 and _finite_checkpoints(r.run))
    return f"rc {r.rc}, {len(errors)} error line(s), {nulls} null losses, checkpoints finite: " \
           f"{_finite_checkpoints(r.run)}", holds


def nan_on_one_rank(data: Path, work: Path) -> tuple[str, bool]:
    r = train(data, work / "run", ranks=2, inject=["nan-rank1-step3"])
    last = (r.records() or [{}])[-1]
    skipped = r.out.count("skipped on every rank")
    holds = r.rc == 0 and last.get("bad_steps") == 1 and last.get("step") == STEPS
    return f"rc {r.rc}, bad_steps {last.get('bad_steps')}, {skipped} skip line(s), " \
           f"reached step {last.get('step')}", holds and skipped == 1


def absurd_scale(data: Path, work: Path) -> tuple[str, bool]:
    r = train(data, work / "run", "margin.s=.inf", "optim.lr=1e400")
    lines = [line for line in r.out.splitlines()
             if "margin.s=inf" in line or "optim.lr=inf" in line]
    started = (work / "run").exists()
    return f"rc {r.rc}, {len(lines)} line(s) naming the keys, run folder made: {started}", \
        r.rc == 2 and len(lines) == 2 and not started
