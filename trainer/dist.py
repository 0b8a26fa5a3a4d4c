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
    """``auto|cpu|cuda`` -> the device of the rank with this ``local_rank``: GPU
    ``local_rank`` (one rank per GPU; ``trainer.config`` refuses more ranks than GPUs, which
    a modulo here would have stacked onto one device)."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def restart_store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """The rendezvous store of this incarnation of the job, keyed by torchrun's restart count.

    Under torchrun the workers share the agent's TCP store (``TORCHELASTIC_USE_AGENT_STORE``),
    which outlives a restart: gloo's rendezvous keys written by the killed incarnation (peer
    addresses) would be read by the new one, which then connects to dead processes
    ("Connection refused/reset") or waits forever. A prefix per ``TORCHELASTIC_RESTART_COUNT``
    gives each incarnation its own keys on the same server.
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent, timeout=timeout)
    return dist.PrefixStore(f"partial_fc/restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}",
                            store)


def default_group_timeout(timeout: timedelta) -> None:
    """Make ``timeout`` what every process group created later without one gets.

    ``dist.new_group(ranks)`` without ``timeout=`` does not inherit the default group's
    timeout: torch gives it its backend's constant (30 min for gloo, 10 min for NCCL;
    ``_get_default_timeout`` in torch/distributed/distributed_c10d.py, torch 2.11 and 2.13).
    DeepSpeed creates its data-parallel group that way (``_clone_world_group`` in
    deepspeed/utils/groups.py; ZeRO's gradient all-reduce runs on it), and passes no timeout
    through ``deepspeed.init_distributed`` either, so a stopped rank or a cut link hung a
    DeepSpeed run for half an hour. torch has no public setting for this default; it reads
    the two module constants below at each ``new_group`` call, so setting them here, next to
    the default group, gives every later group of any library (DeepSpeed's today, its MoE or
    sequence-parallel groups, ours) the one ``dist.timeout_s``.
    """
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def init_distributed(device: str, timeout_s: float = 300.0) -> DistEnv:
    """Start the default process group (once per process) and return this rank's place.

    Call after the config is validated: a bad config must fail before any rendezvous.
    ``timeout_s`` (config ``dist.timeout_s``) bounds every collective, on the default group
    and on every group created later (:func:`default_group_timeout`): a rank that stopped
    ends the run after that long instead of hanging it.
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
        default_group_timeout(timeout)
        if "MASTER_ADDR" in os.environ:
            store = restart_store(rank, world, timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                    timeout=timeout)
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
