"""Import an insightface arcface_torch output folder as a partial-fc run.

arcface_torch (``train_v2.py``) writes into its output folder ``model.pt`` (rank 0's backbone
state_dict) and, with ``save_all_states``, one ``checkpoint_gpu_{rank}.pt`` per rank:
``state_dict_backbone``, ``state_dict_softmax_fc`` (``PartialFC_V2``'s ``weight``: that rank's
contiguous block of class rows, ``num_classes // P`` plus one on the first
``num_classes % P`` ranks, the split ``partial_fc.partition.split_evenly`` makes),
``state_optimizer`` (one torch optimizer over ``[{backbone params}, {head weight}]``),
``state_lr_scheduler`` (``PolynomialLRWarmup``), ``epoch`` and ``global_step``.

:func:`import_run` turns the shards into a partial-fc checkpoint written by the trainer's
own storage (``trainer.checkpoint.save``, one process): the backbone, the head rows in class
order, the optimizers' per-row and per-parameter state where the file has it, and the step.
A run on any number of ranks then resumes from it. The LR schedule's position is kept through
the config: ``train.max_steps``, ``schedule.warmup_epochs``, ``schedule.power`` and
``optim.lr`` are set from the scheduler's state. :func:`import_model` does the same for a
folder holding only ``model.pt``: a backbone-only checkpoint that ``launch.evaluate`` and
``launch.export`` read and a config that fine-tunes it with a new head
(``backbone.weights``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from data_pipeline.manifest import atomic_write_bytes
from data_pipeline.position import ImportedPlan
from offline.insightface.backbones import ImportRefused, convert_state, is_parameter
from offline.insightface.config import negative_warmup_lr
from partial_fc.partition import split_evenly
from trainer.checkpoint import LATEST, CheckpointMeta, tag_for
from trainer.checkpoint.integrity import META, sha256

SHARD = re.compile(r"^checkpoint_gpu_(\d+)\.pt$")
KEYS = ("state_dict_backbone", "state_dict_softmax_fc", "state_optimizer",
        "state_lr_scheduler", "epoch", "global_step")


@dataclass(frozen=True)
class Shards:
    """What the folder's ``checkpoint_gpu_*.pt`` hold, in class order."""

    network: str  # our backbone name
    embedding_size: int
    backbone: dict[str, Tensor]  # rank 0's, our keys
    head: Tensor  # [num_classes, D]
    head_state: dict[str, Tensor]  # per-row optimizer state, [num_classes, ...]
    backbone_state: dict[str, Tensor]  # "backbone_opt.<our name>.<key>"
    optimizer: str  # sgd | adamw
    schedule: dict[str, Any]  # PolynomialLRWarmup's state
    epoch: int
    global_step: int


def load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load raises many types for a bad file
        raise ImportRefused(f"{path}: not readable with torch.load(weights_only=True) "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None


def shard_paths(src: Path) -> list[Path]:
    """``checkpoint_gpu_0.pt`` .. ``_{P-1}.pt``; refuses a gap (a missing shard) by name."""
    ranks = sorted(int(m[1]) for p in src.iterdir() if (m := SHARD.match(p.name)))
    for expected, rank in enumerate(ranks):
        if rank != expected:
            raise ImportRefused(f"{src / f'checkpoint_gpu_{expected}.pt'}: missing (found "
                                f"ranks {ranks}; an arcface_torch run writes one per rank)")
    return [src / f"checkpoint_gpu_{r}.pt" for r in ranks]


def read_shards(paths: list[Path], num_classes: int | None, architecture: dict[str, Any]
                ) -> Shards:
    """Read and check every rank's file; ``num_classes`` (the config's, if known) must be the
    rows' sum; ``architecture``: ``convert_state``'s ``network`` / ``ours`` / ``depth``."""
    world = len(paths)
    ckpts = [load(p) for p in paths]
    for path, ckpt in zip(paths, ckpts, strict=True):
        missing = [k for k in KEYS if not isinstance(ckpt, dict) or k not in ckpt]
        if missing:
            raise ImportRefused(f"{path}: missing {missing}; not an arcface_torch checkpoint "
                                "(train_v2.py with save_all_states=True writes them)")
        head = ckpt["state_dict_softmax_fc"]
        if not (isinstance(head, dict) and isinstance(head.get("weight"), Tensor)):
            raise ImportRefused(f"{path}: state_dict_softmax_fc has no 'weight' tensor")
    rows = [c["state_dict_softmax_fc"]["weight"] for c in ckpts]
    total = num_classes if num_classes is not None else sum(r.shape[0] for r in rows)
    name, size, backbone, keys = convert_state(ckpts[0]["state_dict_backbone"],
                                               str(paths[0]), **architecture)
    for rank, (path, w) in enumerate(zip(paths, rows, strict=True)):
        start, stop = split_evenly(total, world, rank)
        if w.ndim != 2 or w.shape != (stop - start, size):
            raise ImportRefused(
                f"{path}: state_dict_softmax_fc.weight is {tuple(w.shape)}; rank {rank} of "
                f"{world} holds classes [{start}, {stop}) of {total}, so expected "
                f"({stop - start}, {size}) (PartialFC_V2's split)")
    for key in ("epoch", "global_step"):
        values = {int(c[key]) for c in ckpts}
        if len(values) > 1:
            raise ImportRefused(f"{paths[0].parent}: the shards disagree on {key} "
                                f"({sorted(values)}); they come from different saves")
    optimizer, head_state, backbone_state = _optimizer_state(paths, ckpts, keys)
    return Shards(name, size, backbone, torch.cat(rows), head_state, backbone_state, optimizer,
                  dict(ckpts[0]["state_lr_scheduler"]), int(ckpts[0]["epoch"]),
                  int(ckpts[0]["global_step"]))


def _optimizer_state(paths: list[Path], ckpts: list[dict], keys: dict[str, str]
                     ) -> tuple[str, dict[str, Tensor], dict[str, Tensor]]:
    """``(sgd|adamw, head per-row state, backbone state)``. train_v2 builds one optimizer over
    ``[{backbone.parameters()}, {head.parameters()}]``, so group 0 indexes the backbone's
    parameters in order and group 1 the head's ``weight``; ``keys``: its backbone keys ->
    ours (``convert_state``)."""
    first = ckpts[0]["state_optimizer"]
    groups = first.get("param_groups", []) if isinstance(first, dict) else []
    if len(groups) != 2 or len(groups[1].get("params", [])) != 1:
        raise ImportRefused(f"{paths[0]}: state_optimizer is not train_v2's (two parameter "
                            "groups: the backbone's, then the head's weight)")
    optimizer = "adamw" if "betas" in groups[0] else "sgd"
    names = [keys[k] for k in ckpts[0]["state_dict_backbone"] if is_parameter(k)]
    if len(names) != len(groups[0]["params"]):
        raise ImportRefused(f"{paths[0]}: state_optimizer indexes {len(groups[0]['params'])} "
                            f"backbone parameters, state_dict_backbone has {len(names)}")
    state = first.get("state", {})
    backbone = {f"backbone_opt.{name}.{key}": torch.as_tensor(value)
                for name, index in zip(names, groups[0]["params"], strict=True)
                for key, value in state.get(index, {}).items()}
    head_index = groups[1]["params"][0]
    per_rank = [c["state_optimizer"].get("state", {}).get(head_index, {}) for c in ckpts]
    head: dict[str, Tensor] = {}
    for key in per_rank[0]:
        parts = [torch.as_tensor(s[key]) for s in per_rank]
        if parts[0].ndim == 0:  # AdamW's scalar step: ours counts per row
            parts = [p.float().expand(w["state_dict_softmax_fc"]["weight"].shape[0]).clone()
                     for p, w in zip(parts, ckpts, strict=True)]
        head[key] = torch.cat(parts)
    return optimizer, head, backbone


def schedule_settings(shards: Shards, grad_accum: int) -> dict[str, Any]:
    """Config keys that put partial-fc's LR schedule where the scheduler's state was: its
    peak lr, power, warm-up and length (``PolynomialLRWarmup`` counts micro-batches; ours
    counts optimisation steps)."""
    sched = shards.schedule
    total = int(sched.get("total_iters", 0)) // grad_accum
    warmup = int(sched.get("warmup_iters", 0)) // grad_accum
    per_epoch = shards.global_step // grad_accum // max(shards.epoch, 1)
    out: dict[str, Any] = {"schedule.type": "poly"}
    power = float(sched.get("power", 1.0))
    if "power" in sched:
        out["schedule.power"] = power
    if sched.get("base_lrs"):
        out["optim.lr"] = float(sched["base_lrs"][0])
        if warmup < 0 < total:  # its warmup_epoch = -1: no warm-up, a lower start
            out["optim.lr"] = negative_warmup_lr(out["optim.lr"], total, warmup, power)
    if total > 0:
        out["train.max_steps"] = total
        if per_epoch > 0:
            out["schedule.warmup_epochs"] = max(warmup, 0) / per_epoch
    return out


def loader_position(epoch: int) -> dict:
    """The loader state that resumes at the start of epoch ``epoch`` on any data and ranks:
    its plan matches no loader's, so every loader resumes at the same fraction, 0, of the
    epoch (``data_pipeline.position.ImportedPlan``)."""
    return {"epoch": epoch, "batches": 0, "rank": 0, "worker_positions": [],
            "plan": ImportedPlan().to_dict()}


def write_backbone_only(out: Path, backbone: dict[str, Tensor], source: Path) -> Path:
    """A verified backbone-only checkpoint ``out/checkpoints/step-00000000`` (backbone.pt
    and its meta.json), which ``trainer.checkpoint.backbone`` reads; returns backbone.pt."""
    folder = out / "checkpoints" / tag_for(0)
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / "backbone.pt"
    torch.save(backbone, weights)
    meta = CheckpointMeta(step=0, world_size=1, loaders=[], rows=[], name=f"{source}",
                          files={"backbone.pt": sha256(weights)})
    atomic_write_bytes(folder / META, meta.to_json().encode())
    atomic_write_bytes(out / "checkpoints" / LATEST, (folder.name + "\n").encode())
    return weights
