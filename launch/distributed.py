"""Process-group setup for ``launch.train`` from torchrun's environment.

torchrun (single node ``--nproc_per_node``, multi node ``--nnodes`` + rendezvous) exports
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; a plain
``python -m launch.train`` has none of them and runs as a 1-rank group on an in-memory
store, so the same code path (DDP/DeepSpeed, collectives in the head) serves both.
Backend: NCCL on CUDA, gloo on CPU. Nothing happens at import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: global rank/size, rank on its node, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def resolve_device(device: str, local_rank: int) -> torch.device:
    """``auto|cpu|cuda`` -> the device of the rank with this ``local_rank``."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def init_distributed(device: str, timeout_s: float = 1800.0) -> DistEnv:
    """Start the default process group (once per process) and return this rank's place.

    Call after the config is validated: a bad config must fail before any rendezvous.
    """
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        else:
            if world != 1:
                raise RuntimeError(f"WORLD_SIZE={world} without MASTER_ADDR: launch with torchrun")
            os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed insists on it
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, dev)


def shutdown() -> None:
    """Destroy the default process group if this process started one."""
    if dist.is_initialized():
        dist.destroy_process_group()
