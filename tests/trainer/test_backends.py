"""The backbone engines behind ``trainer.engine.backend.BackboneBackend``, and ``StepResult``.

Every entry of ``trainer.engine.BACKENDS`` is held to the Protocol by the same test body:
its methods have the Protocol's signatures, and driven directly (no Engine step around it)
it calls ``agree`` once per step, leaves the backbone untouched when the vote is against the
step, updates it when the vote is for it, and round-trips its optimizer state into a fresh
backend. ``StepResult`` is checked from the reader's side: ``trainer.loop.one_step`` counts
overflows, bad steps and stop requests from its fields.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

import pytest
import torch
from launch_helpers import build_engine, local_micro_batches, make_config
from spawn import run_ranks

from trainer.engine import BACKENDS, BackboneBackend, StepResult

BATCH = 4


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_backend_methods_have_the_protocol_signatures(name):
    members = [m for m in vars(BackboneBackend) if callable(getattr(BackboneBackend, m))
               and not m.startswith("_")]
    assert members, "the Protocol declares no methods"
    for member in members:
        expected = inspect.signature(getattr(BackboneBackend, member))
        actual = inspect.signature(getattr(BACKENDS[name], member))
        assert list(actual.parameters) == list(expected.parameters), (name, member)


def _params(engine) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in engine.backbone.parameters()])


def _one_vote(engine, finite: bool) -> dict:
    """One micro-batch through ``engine.backend`` alone, with ``agree`` voting ``finite``."""
    backend, calls = engine.backend, []
    images, _ = local_micro_batches(0, BATCH, 0, 1, 1)[0]
    x = images.float().div(255).to(backend.input_dtype)

    def agree(backbone_finite):
        calls.append(backbone_finite)
        return torch.tensor([int(finite), 1, 0], dtype=torch.int32)

    with backend.micro_batch(boundary=True):
        with backend.autocast():
            emb = backend.model(x)
        pending = backend.last_backward(emb.float().square().mean(), 0, agree)
    update = backend.update(pending, finite)
    return {"calls": len(calls), "applied": update.applied, "overflow": update.overflow}


def _contract(rank: int, world: int) -> dict:
    """In a spawned rank: DeepSpeed caches the first process group it sees."""
    os.environ.setdefault("LOCAL_RANK", "0")
    out = {}
    for name in sorted(BACKENDS):
        cfg = make_config(f"engine.type={name}", "engine.zero_stage=1", "optim.lr=0.1",
                          f"train.batch_size={BATCH}")
        engine = build_engine(cfg)
        before = _params(engine)
        against = _one_vote(engine, finite=False)
        kept = torch.equal(_params(engine), before)
        voted = _one_vote(engine, finite=True)
        moved = not torch.equal(_params(engine), before)
        state = engine.backend.optimizer_state()
        fresh = build_engine(cfg)
        fresh.backend.load_optimizer_state(state)
        again = fresh.backend.optimizer_state()
        same = state.keys() == again.keys() and all(torch.equal(state[k], again[k])
                                                     for k in state)
        out[name] = {"protocol": isinstance(engine.backend, BackboneBackend), "against": against,
                     "kept": kept, "for": voted, "moved": moved, "state": sorted(state),
                     "round_trip": same}
    return out


def test_every_backend_keeps_the_contract():
    (out,) = run_ranks(_contract, 1, timeout=300)
    assert sorted(out) == sorted(BACKENDS)
    for name, r in out.items():
        assert r["protocol"], name
        assert r["against"] == {"calls": 1, "applied": False, "overflow": False}, name
        assert r["kept"], name
        assert r["for"] == {"calls": 1, "applied": True, "overflow": False}, name
        assert r["moved"], name
        assert r["state"] and r["round_trip"], (name, r["state"])
    # ZeRO-1 keeps full fp32 master weights beside the torch optimizer's state; DDP does not
    assert any(k.startswith("backbone_fp32.") for k in out["deepspeed"]["state"])
    assert all(k.startswith("backbone_opt.") for k in out["ddp"]["state"])


def _result(skipped=False, overflow=False, stop_request=0) -> StepResult:
    return StepResult(lr=0.1, skipped=skipped, overflow=overflow, stop_request=stop_request,
                      numbers={"loss": float("nan") if skipped else 1.0, "grad_norm": 1.0})


class _Scripted:
    """An engine whose steps return the given results in turn."""

    def __init__(self, results):
        self.results = list(results)
        self.head = type("Head", (), {"stats": {}, "take_notes": lambda self: []})()

    def step(self, step, micro_batches, angles=False, stop_request=0):
        return self.results.pop(0)


def test_the_loop_counts_steps_from_the_step_result(tmp_path, one_rank_group):
    from trainer.dist import attach
    from trainer.loop import Diverged, Run, one_step
    from trainer.telemetry.logger import RunLogger

    cfg = make_config(f"output={tmp_path}", "log.every=1000", "log.hist_every=0",
                      "log.progress=false", "train.max_bad_steps=2")
    results = [_result(skipped=True, overflow=True), _result(skipped=True),
               _result(stop_request=10), _result(skipped=True), _result(skipped=True)]
    run = Run(cfg, attach(torch.device("cpu")), _Scripted(results), loader=None,
              log=RunLogger(cfg, 1, total_steps=100, global_batch=8), total=100,
              steps_per_epoch=100)
    seen = [one_step(run, []) for _ in range(3)]
    assert seen == [0, 0, 10]  # the agreed stop request, after the step that carried it
    assert (run.skipped_steps, run.bad_steps, run.bad_in_a_row) == (1, 1, 0)
    one_step(run, [])
    with pytest.raises(Diverged):
        one_step(run, [])
    assert (run.step, run.bad_steps, run.bad_in_a_row) == (5, 3, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        results[0].skipped = False
