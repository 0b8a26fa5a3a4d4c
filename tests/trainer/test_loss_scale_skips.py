"""A step DeepSpeed's fp16 loss scaler drops is dropped by the head's optimizer too, and counted.

DeepSpeed's fp16 optimizer skips an update whose *scaled* gradients overflowed (it then halves
the scale) and reports it through ``was_step_applied()``. The head lives outside DeepSpeed, so
``Engine.step`` must skip the head's update on the same step, put every buffer back, and report
``overflow`` (a loss-scale skip, counted as ``skipped_steps``, not a diverging step).

On CPU fp16 does not run (no fp16 kernels here), so the CPU test makes DeepSpeed's ZeRO-1
engine behave as its scaler does on an overflow - no update, ``was_step_applied() == False`` -
and checks what this project's code does with that; likewise for the scaler's dead end (an
overflow at its minimum scale raises a bare Exception), which must end the run with one line
and is told from other failures by its type and the scaler's state, not its text.
The cuda-marked test overflows a real fp16 scaler (initial scale 2^32).
"""

from __future__ import annotations

import os

import pytest
import torch
from launch_helpers import (
    build_engine,
    local_micro_batches,
    make_config,
    same_snapshots,
    snapshot,
)
from spawn import run_ranks

GLOBAL_BATCH = 8


def _drop_next_update(model) -> None:
    """DeepSpeed's overflow behaviour for the next ``step()``: gradients cleared, no update,
    ``was_step_applied()`` False once (deepspeed/runtime/engine.py ``_take_model_step``)."""
    step, applied = model.step, model.was_step_applied

    def overflowed_step(*args, **kwargs):
        model.step = step
        model.zero_grad()

    def not_applied():
        model.was_step_applied = applied
        return False

    model.step, model.was_step_applied = overflowed_step, not_applied


def _dropped_step(rank: int, world: int) -> dict:
    """In a spawned rank: DeepSpeed caches the first process group it sees, so its engines
    must not share a test process with other groups."""
    os.environ.setdefault("LOCAL_RANK", "0")
    out = {}
    for precision in ("fp16", "bf16"):
        cfg = make_config("engine.type=deepspeed", "engine.zero_stage=1",
                          f"train.batch_size={GLOBAL_BATCH}")
        engine = build_engine(cfg)
        # The engine runs fp32 on CPU; only the overflow classification reads the precision.
        engine.backend.precision = precision
        engine.step(0, local_micro_batches(0, GLOBAL_BATCH, 0, 1, 1))  # momentum exists
        before = snapshot(engine)
        _drop_next_update(engine.backend.model)
        dropped = engine.step(1, local_micro_batches(1, GLOBAL_BATCH, 0, 1, 1))
        unchanged = same_snapshots(snapshot(engine), before)
        nxt = engine.step(2, local_micro_batches(2, GLOBAL_BATCH, 0, 1, 1))
        moved = not torch.equal(snapshot(engine)["rows"], before["rows"])
        out[precision] = (dropped.skipped, dropped.overflow, unchanged,
                          nxt.skipped or nxt.overflow, moved)
    out["floor"] = _at_minimum_scale(engine)
    return out


def _at_minimum_scale(engine) -> list[str]:
    """What ``Engine.step`` raises when DeepSpeed's step raises: its scaler's bare Exception
    with the scale at its minimum (deepspeed/runtime/fp16/loss_scaler.py), the same above the
    minimum, and another type at the minimum (only the first is the scaler's dead end)."""
    engine.backend.precision = "fp16"  # the engine runs fp32 here; the check reads this
    optimizer, seen = engine.backend.model.optimizer, []
    for error, scale in ((Exception, 1.0), (Exception, 2.0), (RuntimeError, 1.0)):
        def failing_step(*args, error=error, scale=scale, **kwargs):
            optimizer.loss_scale = scale  # where the scaler stands when it raises
            raise error("Current loss scale already at minimum - cannot decrease scale "
                        "anymore. Exiting run.")

        engine.backend.model.step = failing_step
        try:
            engine.step(4, local_micro_batches(4, GLOBAL_BATCH, 0, 1, 1))
        except Exception as err:  # noqa: BLE001 - the type is what is checked
            seen.append(f"{type(err).__name__}: {err}")
    return seen


def test_dropped_deepspeed_step_skips_the_head_too():
    (out,) = run_ranks(_dropped_step, 1)
    floor, above, other_type = out.pop("floor")
    assert floor.startswith("LossScaleFloor: step 5: fp16 gradients overflow even at "), floor
    assert "engine.precision=bf16" in floor, floor
    assert above.startswith("Exception: ") and other_type.startswith("RuntimeError: "), \
        (above, other_type)
    for precision, (skipped, overflow, unchanged, next_skipped, moved) in out.items():
        assert skipped and unchanged, precision
        # fp16: the scaler's own skip; bf16 has no scaler, so a drop is a non-finite gradient.
        assert overflow == (precision == "fp16"), precision
        assert not next_skipped and moved, precision


def _real_overflow(rank: int, world: int) -> list[tuple[bool, bool, bool]]:
    """In a spawned process (DeepSpeed caches its first group): a 1-rank NCCL group, fp16
    ZeRO-1 with the loss scale starting at 2^32 (x any gradient overflows fp16's 6.5e4)."""
    import torch.distributed as dist

    import trainer.engine.deepspeed_backend as ds_module

    os.environ.setdefault("LOCAL_RANK", "0")
    make_ds = ds_module.deepspeed_config

    def huge_initial_scale(cfg, world_size):
        out = make_ds(cfg, world_size)
        out["fp16"].update(initial_scale_power=32)
        return out

    ds_module.deepspeed_config = huge_initial_scale
    dist.destroy_process_group()  # the spawned gloo group: this one runs on NCCL
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    cfg = make_config("engine.type=deepspeed", "engine.zero_stage=1", "engine.precision=fp16",
                      f"train.batch_size={GLOBAL_BATCH}")
    engine = build_engine(cfg, device="cuda:0")
    before, seen = snapshot(engine), []
    for s in range(40):  # the scale halves per overflow: 2^32 -> a working scale
        out = engine.step(s, local_micro_batches(s, GLOBAL_BATCH, 0, 1, 1))
        seen.append((out.skipped, out.overflow, same_snapshots(snapshot(engine), before)))
        if not out.skipped:
            break
    return seen


def test_a_step_that_creates_optimizer_state_is_no_longer_the_same_snapshot():
    """The first applied step gives the head's optimizer its momentum: the snapshots differ
    (``same_snapshots`` says so rather than failing on the new key, as it did on the GPU)."""
    rows = torch.zeros(2, 3)
    before = {"rows": rows, "backbone": {}, "head_opt": {}, "head_state": {}}
    after = {**before, "head_opt": {"momentum_buffer": torch.zeros(2, 3)}}
    assert same_snapshots(before, dict(before)) and not same_snapshots(after, before)
    assert not same_snapshots(before, after)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_fp16_overflow_skips_backbone_and_head():
    (seen,) = run_ranks(_real_overflow, 1, timeout=300)
    *dropped, (last_skipped, last_overflow, last_unchanged) = seen
    assert dropped and all(skip and overflow and same for skip, overflow, same in dropped), seen
    assert not last_skipped and not last_overflow and not last_unchanged, seen


def test_minimum_loss_scale_is_one_line_not_a_traceback(capsys, monkeypatch, tmp_path):
    from trainer.engine.deepspeed_backend import LossScaleFloor
    from trainer.failures import report_failure

    monkeypatch.delenv("RANK", raising=False)
    err = LossScaleFloor("step 7: fp16 gradients overflow even at DeepSpeed's minimum loss scale")
    assert report_failure(err, 0, tmp_path) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: {err}"], lines
