"""What the config checks know about the machine and the launch: one frozen snapshot.

:meth:`Machine.observe` is the one place in ``trainer.config`` that reads the process
environment (torchrun's ``WORLD_SIZE``/``LOCAL_WORLD_SIZE``, ``WANDB_MODE``), torch's device
state (CUDA, GPU count and memory, bf16, NCCL), the node's memory and which optional packages
are installed; it runs once, at
the edge (``launch.train``, or :func:`trainer.config.load_config` when given no machine). The
checks take the snapshot as an argument, so a test states the machine it means
(``Machine(gpus=2, local_ranks=3, world_size=3)``) instead of faking torch, and a check for
another launch shape (``launch.train --check --nproc-per-node N --nnodes M``) is
:meth:`Machine.launching`, not an environment variable.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

# The optional packages a config can ask for: the engine, the logging sinks, the head's tiles.
OPTIONAL_PACKAGES = ("deepspeed", "wandb", "tensorboard", "triton")


@dataclass(frozen=True)
class Machine:
    """This node and the launch it belongs to, as the config checks see them.

    ``local_ranks``: ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``; 1 without torchrun);
    ``world_size``: ranks of the whole launch (``WORLD_SIZE``); ``gpus``: CUDA devices
    visible to this process (0: no CUDA); ``bf16``: the GPU computes in bf16; ``nccl``: this
    torch build has NCCL; ``installed``: the :data:`OPTIONAL_PACKAGES` importable here;
    ``wandb_mode``: ``WANDB_MODE``, which wins over ``log.wandb`` (None: unset);
    ``gpu_memory``: bytes of one visible GPU, ``host_memory``: the node's physical memory in
    bytes, shared by its ranks (None: not known, nothing is checked against it). The defaults
    are a one-process CPU machine with no optional package.
    """

    local_ranks: int = 1
    world_size: int = 1
    gpus: int = 0
    bf16: bool = False
    nccl: bool = False
    installed: frozenset[str] = frozenset()
    wandb_mode: str | None = None
    gpu_memory: int | None = None
    host_memory: int | None = None

    @property
    def cuda(self) -> bool:
        """Whether torch sees a CUDA device (``torch.cuda.is_available()``)."""
        return self.gpus > 0

    def has(self, package: str) -> bool:
        """Whether the optional ``package`` is installed."""
        return package in self.installed

    def launching(self, ranks_per_node: int, nnodes: int = 1) -> Machine:
        """This machine for a launch of ``ranks_per_node`` x ``nnodes`` ranks (what torchrun
        would export as ``LOCAL_WORLD_SIZE``/``WORLD_SIZE``)."""
        return dataclasses.replace(self, local_ranks=ranks_per_node,
                                   world_size=ranks_per_node * nnodes)

    @classmethod
    def observe(cls) -> Machine:
        """Read this machine once: torch's devices, the installed packages, ``WANDB_MODE``,
        and the launch shape from torchrun's variables (a launch being checked before
        torchrun starts it: :meth:`launching`)."""
        import torch
        import torch.distributed as dist

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return cls(
            local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            gpus=gpus,
            bf16=bool(gpus) and torch.cuda.is_bf16_supported(),
            nccl=dist.is_available() and dist.is_nccl_available(),
            installed=frozenset(p for p in OPTIONAL_PACKAGES if _installed(p)),
            wandb_mode=os.environ.get("WANDB_MODE") or None,
            gpu_memory=torch.cuda.get_device_properties(0).total_memory if gpus else None,
            host_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        )


def _installed(package: str) -> bool:
    """Whether ``package`` can be imported (checked without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # in sys.modules as None: import refused
        return False
