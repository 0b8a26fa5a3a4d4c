"""Checkpoint storage: torch.distributed.checkpoint (DCP) folders, written atomically.

Layout (the contract others read)::

    RUN/checkpoints/<tag>/state/          DCP: every rank writes its head rows, rank-deduped
                                          replicated tensors (see launch.state for the plan)
    RUN/checkpoints/<tag>/backbone.pt     plain full fp32 backbone state_dict (rank 0)
    RUN/checkpoints/<tag>/meta.json       step, epoch, world size, loader positions, row keys
    RUN/checkpoints/<tag>/rng-<rank>.pt   that rank's torch RNG state (CPU, and CUDA on GPU)
    RUN/checkpoints/latest                the newest <tag>

A checkpoint is written into ``checkpoints/.tmp-<tag>`` and renamed when complete, and
``latest`` is replaced with ``os.replace``, so a crash never leaves a folder that looks
finished; the next completed save removes its ``.tmp-*`` leftovers. Multi-node runs need
RUN on a file system every node sees.

Head rows are saved as a ``ShardedTensor`` with each rank's true row offset. DTensor's
``Shard(0)`` would fix the offsets to ``torch.chunk``'s split, which differs from the head's
remainder-balanced partition (C=10, P=4: 3,3,3,1 vs 3,3,2,2); DCP reads any row range back
from either, so a run resumes on a different number of ranks with identical rows.
Everything is loaded with ``weights_only=True`` (DCP stores raw tensors, no pickles).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from launch import state as plan

LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that must not be written or read; the message names the step or file."""


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


@contextlib.contextmanager
def _quiet():
    """DCP warns that ShardedTensor is deprecated in favour of DTensor (see module doc)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        yield


def _sharded(rows: plan.Rows) -> torch.Tensor:
    local = rows.local.detach().cpu().contiguous()
    shape = [rows.total, *local.shape[1:]]
    md = ShardMetadata(
        shard_offsets=[rows.offset] + [0] * (local.ndim - 1),
        shard_sizes=list(local.shape),
        placement=f"rank:{dist.get_rank()}/cpu",
    )
    with _quiet():
        return init_from_local_shards([Shard(local, md)], shape)


def save(run_dir: Path, step: int, engine, meta: dict, keep: int) -> Path:
    """Write checkpoint ``step`` of ``engine`` (collective). ``meta`` must be JSON-able.

    ``meta["loader"]`` (this rank's loader position) is gathered into a per-rank list.
    """
    rank = dist.get_rank()
    root = Path(run_dir) / "checkpoints"
    tag = tag_for(step)
    tmp, final = root / f".tmp-{tag}", root / tag
    full = plan.collect(engine)
    _refuse_non_finite(full, step)
    rows = sorted(k for k, v in full.items() if isinstance(v, plan.Rows))
    loaders: list = [None] * dist.get_world_size()
    dist.all_gather_object(loaders, meta.get("loader"))
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    flat = {k: _sharded(v) if k in rows else v.detach().cpu() for k, v in full.items()}
    with _quiet():
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(tmp / "state"))
    torch.save(_rng_state(engine.device), tmp / f"rng-{rank}.pt")
    if rank == 0:
        torch.save(_plain_backbone(full), tmp / "backbone.pt")
        info = {
            **meta,
            "loader": loaders,
            "step": step,
            "world_size": dist.get_world_size(),
            "rows": rows,
        }
        (tmp / "meta.json").write_text(json.dumps(info, indent=1))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        _write_atomic(root / LATEST, tag + "\n")
        _prune(root, keep)
    dist.barrier()
    return final


def _refuse_non_finite(full: dict, step: int) -> None:
    """Raise on every rank, before anything is written or pruned, if any rank's state holds
    inf/NaN: a checkpoint must never replace good ones with a diverged model (collective)."""
    bad = [
        key
        for key, value in full.items()
        if (t := value.local if isinstance(value, plan.Rows) else value).is_floating_point()
        and not bool(torch.isfinite(t).all())
    ]
    flag = torch.tensor([len(bad)])
    dist.all_reduce(flag)
    if int(flag):
        where = f"{bad[0]} and {len(bad) - 1} more" if bad else "another rank's state"
        raise CheckpointError(f"not saving step {step}: non-finite values in {where}")


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The generators a step draws from: torch's CPU one, and the device's on CUDA (dropout)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _plain_backbone(full: dict) -> dict[str, torch.Tensor]:
    """The backbone state_dict, with DeepSpeed's fp32 master weights where it keeps them."""
    out = {}
    for key, value in full.items():
        if key.startswith("backbone."):
            name = key[len("backbone.") :]
            master = full.get(f"backbone_fp32.{name}")
            out[name] = (master if master is not None else value).detach().cpu().clone()
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints; drop ``.tmp-*`` left by interrupted saves.

    Runs on rank 0 after a save completed, so no other save is writing a ``.tmp-*``.
    """
    tags = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in [*tags[:-keep], *root.glob(".tmp-*")]:
        shutil.rmtree(old, ignore_errors=True)


def find_resume(run_dir: Path, resume: str) -> Path | None:
    """``checkpoint.resume`` -> the folder to resume from.

    ``none``: start fresh; ``auto``: ``run_dir``'s latest checkpoint, if any; otherwise a
    checkpoint folder, or another run's folder (its latest checkpoint).
    """
    if resume == "none":
        return None
    folder = Path(run_dir) if resume == "auto" else Path(resume)
    latest = folder / "checkpoints" / LATEST
    if latest.is_file():
        return latest.parent / latest.read_text().strip()
    return None if resume == "auto" else folder


def load(path: Path, engine) -> dict:
    """Restore ``engine`` from checkpoint folder ``path`` on any world size (collective).

    Returns the meta dict, with ``meta["loader"]`` narrowed to this rank's loader state
    (rank 0's when the checkpoint had fewer ranks; the loader converts it).
    """
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    reader = dcp.FileSystemReader(path / "state")
    head, rows = engine.head, set(meta["rows"])
    template: dict[str, torch.Tensor] = {}
    for key, md in reader.read_metadata().state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{path}: entry {key!r} is not a tensor; not a partial-fc checkpoint")
        if key in rows:
            local = torch.zeros([head.num_local, *md.size[1:]], dtype=md.properties.dtype)
            template[key] = _sharded(plan.Rows(local, head.class_start, md.size[0]))
        else:
            template[key] = torch.zeros(md.size, dtype=md.properties.dtype)
    with _quiet():
        dcp.load(template, storage_reader=reader)
        flat = {k: v.local_tensor() if k in rows else v for k, v in template.items()}
    plan.restore(engine, flat)
    rank = dist.get_rank()
    rng = path / f"rng-{rank}.pt"
    if rng.is_file():
        saved = torch.load(rng, weights_only=True)
        torch.set_rng_state(saved["cpu"])
        if "cuda" in saved and engine.device.type == "cuda":
            torch.cuda.set_rng_state(saved["cuda"], engine.device)
    loaders = meta["loader"]
    meta["loader"] = loaders[rank] if rank < len(loaders) else loaders[0]
    return meta
