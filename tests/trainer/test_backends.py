"""The backbone engines behind ``trainer.engine.backend.BackboneBackend``, and ``StepResult``.

Every entry of ``trainer.engine.BACKENDS`` is held to the Protocol by the same test body:
its methods have the Protocol's signatures, and driven directly (no Engine step around it)
it leaves the backbone untouched on a verdict against the step, updates it on a verdict for
it, and round-trips its optimizer state into a fresh
backend. ``StepResult`` is checked from the reader's side: ``trainer.loop.one_step`` counts
overflows, bad steps and stop requests from its fields.
"""

from __future__ import annotations

import inspect
import os
from types import SimpleNamespace

import pytest
import torch
from launch_helpers import build_engine, local_micro_batches, make_config
from spawn import run_ranks

from trainer.engine import BACKENDS, BackboneBackend, StepResult
from trainer.engine.backend import Verdict
from trainer.engine.deepspeed_backend import overflow_unless
from trainer.stopping import NO_STOP, StopReason, StopRequest

BATCH = 4
CUDA0 = torch.device("cuda", 0)


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
    """One micro-batch through ``engine.backend`` alone, on a verdict for (``finite``) or
    against the step."""
    backend = engine.backend
    images, _ = local_micro_batches(0, BATCH, 0, 1, 1)[0]
    x = images.float().div(255).to(backend.input_dtype)
    with backend.micro_batch(boundary=True):
        with backend.autocast():
            emb = backend.model(x)
        own = backend.last_backward(emb.float().square().mean())
    flag = torch.tensor(finite) if own is None else own & torch.tensor(finite)
    verdict = Verdict.agree(flag, StopRequest(), group=None)
    update = backend.update(verdict, 0)
    return {"own_flag": None if own is None else bool(own), "applied": update.applied,
            "overflow": update.overflow, "norm_finite": bool(torch.isfinite(
                torch.as_tensor(update.grad_norm))) if finite else None}


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
        master = engine.backend.master_weights(state)
        trainable = {n: p for n, p in engine.backbone.named_parameters() if p.requires_grad}
        out[name] = {"protocol": isinstance(engine.backend, BackboneBackend), "against": against,
                     "kept": kept, "for": voted, "moved": moved, "state": sorted(state),
                     "round_trip": same, "master": sorted(master) == sorted(trainable)
                     and all(torch.equal(master[n].float(), p.detach().float().cpu())
                             for n, p in trainable.items()), "no_master": master == {}}
    return out


def test_every_backend_keeps_the_contract():
    (out,) = run_ranks(_contract, 1, timeout=300)
    assert sorted(out) == sorted(BACKENDS)
    for name, r in out.items():
        assert r["protocol"], name
        own = None if name == "deepspeed" else True  # DeepSpeed checks its own gradients
        assert r["against"] == {"own_flag": own, "applied": False, "overflow": False,
                                "norm_finite": None}, name
        assert r["kept"], name
        assert r["for"] == {"own_flag": own, "applied": True, "overflow": False,
                            "norm_finite": True}, name
        assert r["moved"], name
        assert r["state"] and r["round_trip"], (name, r["state"])
    # ZeRO-1 keeps full fp32 master weights beside the torch optimizer's state; DDP does not
    assert any(k.startswith("fp32.") for k in out["deepspeed"]["state"])
    assert out["deepspeed"]["master"] and out["ddp"]["no_master"]  # ZeRO's master = the fp32
    assert all(k.startswith("opt.") for k in out["ddp"]["state"])


def _result(skipped=False, overflow=False, stop=NO_STOP) -> StepResult:
    return StepResult(lr=0.1, skipped=skipped, overflow=overflow, stop=stop,
                      numbers={"loss": float("nan") if skipped else 1.0, "grad_norm": 1.0})


class _Scripted:
    """An engine whose steps return the given results in turn."""

    def __init__(self, results):
        self.results = list(results)

    def step(self, step, micro_batches, angles=False, stops=None):
        return self.results.pop(0)


def test_the_loop_counts_steps_from_the_step_result(tmp_path, one_rank_group):
    from trainer.dist import attach
    from trainer.loop import Diverged, one_step
    from trainer.run_state import Run
    from trainer.telemetry.logger import RunLogger

    cfg = make_config(f"output={tmp_path}", "log.every=1000", "log.hist_every=0",
                      "log.progress=false", "train.max_bad_steps=2")
    signal_10 = StopRequest(StopReason.SIGNAL, 10)
    results = [_result(skipped=True, overflow=True), _result(skipped=True),
               _result(stop=signal_10), _result(skipped=True), _result(skipped=True)]
    run = Run(cfg, attach(torch.device("cpu")), _Scripted(results), loader=None,
              log=RunLogger(cfg, 1, total_steps=100, global_batch=8), total=100,
              steps_per_epoch=100)
    seen = [one_step(run, []) for _ in range(3)]
    assert seen == [StopRequest(), StopRequest(), signal_10]  # the agreed one, after its step
    assert (run.skipped_steps, run.bad_steps, run.bad_in_a_row) == (1, 1, 0)
    one_step(run, [])
    with pytest.raises(RuntimeError) as diverged:  # a failed run: its builtin base
        one_step(run, [])
    assert type(diverged.value) is Diverged
    assert (run.step, run.bad_steps, run.bad_in_a_row) == (5, 3, 2)


@pytest.mark.parametrize("apply", [True, False])
def test_overflow_unless_keeps_the_gradient_or_makes_every_one_non_finite(apply):
    """DeepSpeed's only way to drop a step (no public skip call): its overflow check must see
    non-finite gradients in every parameter, including those whose gradient would be 0."""
    w = torch.tensor([1.0, -2.0, 0.0], requires_grad=True)
    x = torch.tensor([3.0, 0.0, 5.0])
    overflow_unless(torch.tensor(apply), (w * x).sum()).backward()
    if apply:
        assert torch.equal(w.grad, x)
    else:
        assert not torch.isfinite(w.grad).any()


@pytest.mark.parametrize("clip", ["1.0", "null"])
def test_ddp_on_one_rank_trains_unwrapped_with_the_wrapped_steps(one_rank_group, tmp_path,
                                                                 clip):
    """One rank: no ``DistributedDataParallel`` around the backbone unless
    ``engine.one_rank_ddp``, and the same steps either way, bit for bit (three steps of two
    accumulated micro-batches, gradient norms included, clipped and not); each engine's
    checkpoint state loads into the other and gives the same next step."""
    from launch_helpers import same_snapshots, snapshot
    from torch.nn.parallel import DistributedDataParallel

    from trainer import checkpoint

    def engine(wrapped: bool):
        return build_engine(make_config(f"engine.one_rank_ddp={wrapped}", "train.batch_size=4",
                                        "train.grad_accum=2", f"train.clip_grad_norm={clip}"))

    def step(e, i: int) -> float:
        return e.step(i, local_micro_batches(i, 8, 0, 1, 2)).grad_norm

    plain, wrapped = engine(False), engine(True)
    assert type(plain.backend.model) is not DistributedDataParallel
    assert type(wrapped.backend.model) is DistributedDataParallel
    for i in range(3):
        assert step(plain, i) == step(wrapped, i)
    assert same_snapshots(snapshot(plain), snapshot(wrapped))
    for n, (source, target) in enumerate(((plain, engine(True)), (wrapped, engine(False)))):
        checkpoint.load(checkpoint.save(tmp_path / str(n), 3, source, checkpoint.RunRecord(),
                                        keep=1), target)
        step(source, 3)
        step(target, 3)
        assert same_snapshots(snapshot(source), snapshot(target))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("clip", ["1.0", "null"])
def test_ddp_gradient_norm_takes_foreach_kernels_on_cuda(monkeypatch, fused, clip):
    """A one-rank DDP backend on a CUDA device (faked: nothing of it touches the GPU
    unwrapped) asks torch for the foreach norm and clip with ``engine.fused_updates``, not
    without; on the CPU never (torch has no foreach kernels there). The norm itself is the
    norm of the per-tensor fp32 norms either way."""
    from trainer.engine.ddp import DDPBackend

    cfg = make_config(f"engine.fused_updates={fused}", f"train.clip_grad_norm={clip}")
    backbone = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.PReLU(4))
    grads = [torch.randn_like(p) for p in backbone.parameters()]
    want = torch.stack([g.norm() for g in grads]).norm()
    asked, utils = [], torch.nn.utils
    real = {name: getattr(utils, name) for name in ("get_total_norm", "clip_grad_norm_")}
    for name, fn in real.items():
        monkeypatch.setattr(utils, name, lambda *a, foreach, fn=fn, **k:
                            asked.append(foreach) or fn(*a, **k, foreach=False))
    for device, foreach in ((CUDA0, fused), (torch.device("cpu"), False)):
        env = SimpleNamespace(device=device, world_size=1, group=None)
        backend = DDPBackend(cfg, backbone, backbone, torch.optim.SGD(backbone.parameters()),
                             env)
        assert backend.model is backbone
        for p, g in zip(backbone.parameters(), grads, strict=True):
            p.grad = g.clone()
        torch.testing.assert_close(backend._clip(), want, rtol=1e-6, atol=0)
        assert asked.pop() is foreach


def test_zero_settings_reach_deepspeeds_zero_section():
    """``engine.zero_settings`` in DeepSpeed's ``zero_optimization`` as its ZeRO config model
    reads them (0/1 as booleans), beside the stage; unset, DeepSpeed's defaults stay."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from trainer.engine.deepspeed_backend import deepspeed_config

    cfg = make_config("engine.type=deepspeed", "engine.zero_stage=2",
                      "engine.zero_settings={overlap_comm: 0, contiguous_gradients: 1, "
                      "reduce_bucket_size: 50000000, allgather_bucket_size: 200000000}")
    zero = deepspeed_config(cfg, 2)["zero_optimization"]
    parsed = DeepSpeedZeroConfig(**zero)
    assert (parsed.stage, parsed.overlap_comm, parsed.contiguous_gradients) == (2, False, True)
    assert (parsed.reduce_bucket_size, parsed.allgather_bucket_size) == (5 * 10**7, 2 * 10**8)
    plain = DeepSpeedZeroConfig(**deepspeed_config(make_config("engine.type=deepspeed"), 2)[
        "zero_optimization"])
    assert plain == DeepSpeedZeroConfig(stage=1)
