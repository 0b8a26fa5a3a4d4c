"""Process-group setup for ``launch.train`` from torchrun's environment.

torchrun (single node ``--nproc_per_node``, multi node ``--nnodes`` + rendezvous) exports
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; a plain
``python -m launch.train`` has none of them and runs as a 1-rank group on an in-memory
store, so the same code path (DDP/DeepSpeed, collectives in the head) serves both.
Backend: NCCL on CUDA, gloo on CPU. Nothing happens at import.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from collections.abc import Callable, Mapping
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

    That count is each node's own, so it tells incarnations apart on one node only: after a
    node left and one joined, the survivor counts 1 and the newcomer 0. A c10d rendezvous
    (launch.rendezvous) therefore turns the shared store off: rank 0 then starts a store of
    this incarnation, on a port its agent picked for it, and no prefix is needed (one would
    part the nodes' ranks).
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent, timeout=timeout)
    if not agent:
        return store
    return dist.PrefixStore(f"partial_fc/restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}",
                            store)


SOCKET_IFNAME = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` (a name or an address) resolves to is a loopback one."""
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return False
    return bool(found) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found)


def route_source(host: str, port: int) -> str:
    """The local address the kernel sends from to reach ``host`` (a UDP connect sends nothing)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.connect(address)
        return sock.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address``; None if none does."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    return None


def _names_this_host_only(master: str) -> bool:
    """``MASTER_ADDR=localhost`` or a 127.x / ::1 literal: the user put every node on this
    host (nodes on one machine, as the tests run them), where loopback is the right route. A
    host *name* that resolves to loopback is the misconfiguration :func:`socket_interface`
    refuses."""
    import ipaddress

    if master == "localhost":
        return True
    try:
        return ipaddress.ip_address(master).is_loopback
    except ValueError:
        return False


def socket_interface(backend: str, environ: Mapping[str, str], hostname: str,
                     loopback: Callable[[str], bool] = is_loopback,
                     source: Callable[[str, int], str] = route_source,
                     interface: Callable[[str], str | None] = interface_of) -> str | None:
    """The interface gloo/NCCL must use on this node, when it cannot find it alone; else None.

    Without ``GLOO_SOCKET_IFNAME`` gloo listens on the address this host's name resolves to:
    where that is 127.0.0.1 (a common /etc/hosts line) the other nodes are told to connect to
    their own loopback, and a multi-node job fails (or hangs) at its first group. The one
    interface known to reach them is the one that routes to ``MASTER_ADDR``. Nothing to do
    for one node (``WORLD_SIZE == LOCAL_WORLD_SIZE``, or a loopback ``MASTER_ADDR`` without
    torchrun), for nodes all on this host (``MASTER_ADDR`` is ``localhost`` or a loopback
    literal), when the user named an interface, or when the name resolves elsewhere.
    Raises :class:`~trainer.config.schema.ConfigError` naming the variable to set when no
    interface routes there (``MASTER_ADDR`` is this node's own loopback name, or no route).
    ``loopback``, ``source``, ``interface``: the OS look-ups (tests replace them).
    """
    from trainer.config.schema import ConfigError

    master = environ.get("MASTER_ADDR")
    if master is None or any(name in environ for name in SOCKET_IFNAME.values()):
        return None
    if "LOCAL_WORLD_SIZE" in environ:
        one_node = environ["LOCAL_WORLD_SIZE"] == environ.get("WORLD_SIZE", "1")
    else:
        one_node = loopback(master)
    if one_node or not loopback(hostname) or _names_this_host_only(master):
        return None
    variable = SOCKET_IFNAME[backend]
    fix = f"set {variable} to this node's interface that reaches the other nodes (see `ip addr`)"
    try:
        address = source(master, int(environ.get("MASTER_PORT", "29500")))
    except OSError as err:
        raise ConfigError(f"this host's name {hostname} resolves to a loopback address and "
                          f"MASTER_ADDR={master} is unreachable ({err}): {fix}") from None
    name = None if loopback(address) else interface(address)
    if name is None:
        raise ConfigError(f"this host's name {hostname} resolves to a loopback address and no "
                          f"network interface routes to MASTER_ADDR={master} (it leaves from "
                          f"{address}): {fix}, or set MASTER_ADDR to node 0's network address")
    return name


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
        interface = socket_interface(backend, os.environ, socket.gethostname())
        if interface is not None:
            os.environ[SOCKET_IFNAME[backend]] = interface
            if local_rank == 0:
                print(f"note: {socket.gethostname()} resolves to a loopback address: "
                      f"{SOCKET_IFNAME[backend]}={interface}, the interface that routes to "
                      f"MASTER_ADDR={os.environ['MASTER_ADDR']}", file=sys.stderr, flush=True)
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
    return attach(dev, local_rank)


def shutdown() -> None:
    """Destroy the default process group if this process started one."""
    if dist.is_initialized():
        dist.destroy_process_group()
