"""trainer.checkpoint: save on 2 ranks, resume on 1 and 3 with identical state and next step.

Three set-ups in one spawned group each: DeepSpeed ZeRO-1 + SGD (backbone optimizer state
partitioned, read back through DeepSpeed's fragment API), DDP + AdamW on a sub-center head
(3 rows per class, per-row head ``step`` counts: a class's rows must move together) and
DDP + SGD with bf16 head weight and momentum (``head.state_dtype``; CurricularFace, whose
``t`` is a head buffer); the ZeRO-1 run uses AdaFace (its norm EMAs are head buffers).
After the load, head rows, head optimizer state (in their saved dtype), head buffers and the
backbone equal what was saved; one more step on the same global batch then equals the
2-rank run's own next step (bf16 rows and momentum: within one bf16 rounding).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from launch_helpers import (
    build_engine,
    full_rows,
    local_micro_batches,
    make_config,
    same_snapshots,
    snapshot,
)
from spawn import run_ranks

GLOBAL_BATCH = 12  # divisible by 1, 2 and 3 ranks
SETUPS = {
    "zero1_sgd": ["engine.type=deepspeed", "engine.zero_stage=1", "optim.name=sgd",
                  "margin.type=adaface"],
    "ddp_adamw_subcenters": ["engine.type=ddp", "optim.name=adamw", "optim.lr=0.01",
                             "margin.subcenters=3"],
    "ddp_sgd_bf16": ["engine.type=ddp", "optim.name=sgd", "head.state_dtype=bf16",
                     "margin.type=curricularface"],
}


def _engine(name: str, world: int):
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed insists; torchrun sets it
    cfg = make_config(*SETUPS[name], f"train.batch_size={GLOBAL_BATCH // world}")
    return build_engine(cfg)


def _step(engine, step: int, rank: int, world: int) -> float:
    return engine.step(step, local_micro_batches(step, GLOBAL_BATCH, rank, world, 1)).loss


def _save(rank: int, world: int, root: str) -> dict:
    from trainer import checkpoint
    out = {}
    for name in SETUPS:
        engine = _engine(name, world)
        for step in range(2):
            _step(engine, step, rank, world)
        record = checkpoint.RunRecord(loader={"rank": rank})
        path = checkpoint.save(Path(root) / name, 2, engine, record, keep=1)
        saved = snapshot(engine)
        loss = _step(engine, 2, rank, world)
        out[name] = {"path": str(path), "saved": saved, "loss": loss, "next": snapshot(engine)}
    return out


def _resume(rank: int, world: int, paths: dict) -> dict:
    from data_pipeline.position import saved_for_rank
    from trainer import checkpoint
    out = {}
    for name, path in paths.items():
        engine = _engine(name, world)
        meta = checkpoint.load(Path(path), engine)
        loaded = snapshot(engine)
        loss = _step(engine, meta.step, rank, world)
        out[name] = {"meta": meta, "loader": saved_for_rank(meta.loaders, rank), "loaded": loaded,
                     "loss": loss, "next": snapshot(engine)}
    return out


def _assert_same(snaps: list[dict], ref: list[dict], what: str, exact: bool) -> None:
    close = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-6))

    def close_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
        """Saved dtype kept; after a step on another rank count bf16 rows may round the other
        way (the fp32 update differs by ~1e-6): within one bf16 unit, 2**-7 relative."""
        if a.dtype != b.dtype:
            return False
        if exact or a.dtype == torch.float32:
            return close(a, b)
        return torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-6)

    assert close_rows(full_rows(snaps), full_rows(ref)), what
    for key in ref[0]["head_opt"]:
        assert close_rows(full_rows(snaps, key), full_rows(ref, key)), (what, key)
    for snap in snaps:
        for key, value in ref[0]["head_state"].items():
            assert torch.equal(snap["head_state"][key], value), (what, key)
        for key, value in ref[0]["backbone"].items():
            assert close(snap["backbone"][key], value), (what, key)


@pytest.mark.slow
def test_resume_on_fewer_and_more_ranks(tmp_path):
    saved = run_ranks(_save, 2, args=(str(tmp_path),), timeout=240)
    paths = {name: saved[0][name]["path"] for name in SETUPS}
    bf16 = saved[0]["ddp_sgd_bf16"]["saved"]
    assert bf16["rows"].dtype == bf16["head_opt"]["momentum_buffer"].dtype == torch.bfloat16
    for name, path in paths.items():
        assert (Path(path).parent / "latest").read_text().strip() == Path(path).name
        plain = torch.load(Path(path) / "backbone.pt", weights_only=True)
        for key, value in saved[0][name]["saved"]["backbone"].items():
            assert torch.equal(plain[key], value), (name, key)
    for world in (1, 3):
        resumed = run_ranks(_resume, world, args=(paths,), timeout=240)
        for name in SETUPS:
            ref = [saved[r][name] for r in range(2)]
            got = [resumed[r][name] for r in range(world)]
            tag = f"{name} 2->{world}"
            _assert_same([g["loaded"] for g in got], [r["saved"] for r in ref], tag, exact=True)
            for g in got:
                assert g["meta"].step == 2 and g["meta"].world_size == 2
                assert g["loss"] == pytest.approx(ref[0]["loss"], rel=1e-5), tag
            _assert_same([g["next"] for g in got], [r["next"] for r in ref], tag, exact=False)
        loaders = [resumed[r][name]["loader"] for r in range(world)]
        assert loaders == [{"rank": min(r, 1) if r < 2 else 0} for r in range(world)]


def _one_rank_engine(device: str = "cpu"):
    cfg = make_config("engine.type=ddp", "train.batch_size=4", "optim.name=adamw", "optim.lr=0.01",
                      "margin.type=adacos", "margin.adacos=dynamic")
    engine = build_engine(cfg)
    engine.step(0, local_micro_batches(0, 4, 0, 1, 1))
    return engine


def test_save_contents_rng_and_atomicity(tmp_path, one_rank_group, monkeypatch):
    import json

    import torch.distributed.checkpoint as dcp

    from trainer import checkpoint
    engine = _one_rank_engine()
    rng = torch.get_rng_state()
    first = checkpoint.save(tmp_path, 1, engine, checkpoint.RunRecord(loader={"pos": 7}), keep=2)
    keys = set(dcp.FileSystemReader(first / "state").read_metadata().state_dict_metadata)
    names = {k.split(".")[0] for k in keys}
    assert names == {"head", "head_opt", "backbone", "backbone_opt"}, keys
    rows = "/rows.0.11"  # one rank: the block of all 11 rows
    assert {f"head.weight{rows}", "head.step", f"head_opt.exp_avg{rows}"} <= keys, keys
    assert any(k.startswith("head.") and k.endswith(".s") for k in keys), keys  # AdaCos scale
    meta = json.loads((first / "meta.json").read_text())
    assert meta["loader"] == [{"pos": 7}] and meta["step"] == 1 and meta["world_size"] == 1

    torch.rand(5)  # move the generator; load must put it back where the save found it
    checkpoint.load(first, engine)
    assert torch.equal(torch.get_rng_state(), rng)

    def crash(state_dict, storage_writer):  # dies half-way through writing the state
        folder = Path(storage_writer.path)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "partial").write_bytes(b"x")
        raise RuntimeError("node lost")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(checkpoint.CheckpointError, match="rank 0: RuntimeError: node lost"):
        checkpoint.save(tmp_path, 2, engine, checkpoint.RunRecord(loader={"pos": 9}), keep=2)
    found = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert found == ["latest", "step-00000001"], found  # the failed save's .tmp-* is gone
    assert checkpoint.find_resume(tmp_path, "auto") == first

    monkeypatch.undo()
    third = checkpoint.save(tmp_path, 3, engine, checkpoint.RunRecord(loader={"pos": 11}), keep=2)
    found = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert found == ["latest", "step-00000001", "step-00000003"], found
    assert checkpoint.find_resume(tmp_path, "auto") == third


def test_bf16_head_state_is_saved_as_bf16_and_fp32_checkpoints_resume_in_bf16(
        tmp_path, one_rank_group):
    """bf16 rows and momentum are stored as bf16 (half the bytes) and load back bit for bit;
    an fp32 checkpoint resumed with head.state_dtype=bf16 gets its rows rounded on load and
    its momentum at the next step (the optimizer keeps state in the weight's dtype)."""
    import torch.distributed.checkpoint as dcp

    from trainer import checkpoint
    def engine(dtype: str, batch: int):
        cfg = make_config("engine.type=ddp", "train.batch_size=4", f"head.state_dtype={dtype}")
        out = build_engine(cfg)
        out.step(0, local_micro_batches(batch, 4, 0, 1, 1))
        return out

    narrow = engine("bf16", 0)
    path = checkpoint.save(tmp_path / "bf16", 1, narrow, checkpoint.RunRecord(), keep=1)
    meta = dcp.FileSystemReader(path / "state").read_metadata().state_dict_metadata
    for key in ("head.weight/rows.0.11", "head_opt.momentum_buffer/rows.0.11"):
        assert meta[key].properties.dtype == torch.bfloat16, key
    other = engine("bf16", 5)  # another step: another state until the load
    assert not same_snapshots(snapshot(other), snapshot(narrow))
    checkpoint.load(path, other)
    assert same_snapshots(snapshot(other), snapshot(narrow))

    wide = engine("fp32", 0)
    path = checkpoint.save(tmp_path / "fp32", 1, wide, checkpoint.RunRecord(), keep=1)
    resumed = engine("bf16", 5)
    checkpoint.load(path, resumed)
    assert torch.equal(resumed.head.weight.detach(), wide.head.weight.detach().bfloat16())
    resumed.step(1, local_micro_batches(1, 4, 0, 1, 1))
    state = resumed.head_optimizer.state[resumed.head.weight]
    assert state["momentum_buffer"].dtype == torch.bfloat16


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rng_is_saved_and_restored(tmp_path, one_rank_group):
    from trainer import checkpoint
    engine = _one_rank_engine()
    engine.device = torch.device("cuda", 0)  # only the RNG bookkeeping looks at it here
    cuda_rng = torch.cuda.get_rng_state(engine.device)
    path = checkpoint.save(tmp_path, 1, engine, checkpoint.RunRecord(), keep=1)
    torch.rand(3, device=engine.device)
    checkpoint.load(path, engine)
    assert torch.equal(torch.cuda.get_rng_state(engine.device), cuda_rng)


def test_deepspeed_internals_are_where_the_backend_expects(one_rank_group):
    """trainer.engine.deepspeed_backend.ZeroPartitions is the only code that reads DeepSpeed
    internals (the flat fp32 partitions and their parameter groups, to create optimizer state
    before a resume fills it); this fails loudly when an installed DeepSpeed moves or renames
    them. (One process group for both stages: DeepSpeed caches the group it first saw.)"""
    import deepspeed
    from deepspeed.utils import safe_get_full_optimizer_state, safe_set_full_optimizer_state

    from trainer.engine.deepspeed_backend import ZeroPartitions

    os.environ.setdefault("LOCAL_RANK", "0")
    for stage in (1, 2):
        cfg = make_config("engine.type=deepspeed", f"engine.zero_stage={stage}",
                          "optim.name=adamw", "optim.lr=0.01", "train.batch_size=4")
        engine = build_engine(cfg)
        engine.step(0, local_micro_batches(0, 4, 0, 1, 1))
        zero = ZeroPartitions.of(engine.backend)
        where = f"DeepSpeed {deepspeed.__version__}, ZeRO-{stage}"
        assert zero is not None, f"{where}: parameters no longer carry a fragment mapping"
        keys, scalars = zero.state_keys()
        assert keys == ["exp_avg", "exp_avg_sq"] and list(scalars) == ["step"], (where, keys)
        zero.create_state(keys, scalars)  # what a resume does before filling the state
        param = next(engine.backbone.parameters())
        value = torch.linspace(-1, 1, param.numel()).reshape(param.shape)
        safe_set_full_optimizer_state(param, value, "exp_avg")
        assert torch.equal(safe_get_full_optimizer_state(param, "exp_avg"), value), where
        assert engine.step(1, local_micro_batches(1, 4, 0, 1, 1)).skipped is False
