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
    """Where this process sits: global rank/size, rank on its node, its device, and the
    process group the trainer's collectives run on.

    The trainer's one answer to "which rank am I" once the group is up: the engine, the
    checkpoint code and the logger take it as a value, never ask ``torch.distributed`` or
    the environment. ``group`` is the one group of a run: the head shards its classes over
    it, DDP averages the backbone over it, and the engine agrees on each step's flags on it
    (``partial_fc`` takes it as its ``process_group`` argument).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: dist.ProcessGroup | None = None  # None: the default group, as torch.distributed has it

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def launcher_rank() -> int:
    """This process's global rank as torchrun exported it (0 without torchrun): the answer
    before a process group exists (a config error, a warning while loading the config)."""
    return _env_int("RANK", 0)


def attach(device: torch.device, local_rank: int = 0) -> DistEnv:
    """This process's place in the default process group, which must be up already (started
    by :func:`init_distributed`, or by a test or tool that starts its own)."""
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.group.WORLD)


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


def init_distributed(device: str, timeout_s: float = 300.0) -> DistEnv:
    """Start the default process group (once per process) and return this rank's place.

    Call after the config is validated: a bad config must fail before any rendezvous.
    ``timeout_s`` (config ``dist.timeout_s``) bounds every collective: a rank that stopped
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
    return attach(dev, local_rank)


def shutdown() -> None:
    """Destroy the default process group if this process started one."""
    if dist.is_initialized():
        dist.destroy_process_group()
