"""Two "nodes" on one machine for the multi-node chaos cases: two network namespaces joined
by a veth pair, one torchrun per namespace (``--nnodes 2 --node_rank i``, one rank each).

Each node runs under ``unshare --uts`` with the hostname ``localhost``, the common cluster
set-up where a node's name resolves to 127.0.0.1: gloo would advertise its loopback address to
the other node, so the run starts only if ``trainer.dist`` picks the veth interface (the one
that routes to ``MASTER_ADDR``). Creating namespaces needs root (CAP_SYS_ADMIN/CAP_NET_ADMIN);
:func:`two_nodes` raises :class:`NoNamespaces` with the reason where that is not permitted.

The host's name server is out of reach from a namespace, so each one gets its own resolver
file (``/etc/netns/<name>/resolv.conf``, which ``ip netns exec`` mounts over
``/etc/resolv.conf``) naming a server on the namespace's loopback, where nothing listens: a
look-up fails at once, as on a cluster whose nodes have no DNS, instead of after the host
resolver's time-outs. torch's store looks up the name of every peer that connects, in its
one server thread, which at 10-50 s a look-up made a node that joined a running job time
out before the store answered it.

``two_nodes(bridge=True)`` joins the nodes through a bridge on the host instead of one veth
pair: the host then holds ``SUBNET.254`` and reaches both nodes (a scheduler's controller on
the host side, tools/slurm), and ``etc`` puts files of one's own over the namespaces' /etc
(a ``hosts`` file naming the nodes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tools.testbed.harness import BASE_ARGS, ROOT, SMOKE, Result

SUBNET = "10.213.7"  # node i has SUBNET.(i+1); node 0 hosts torchrun's store
PORT = 29411
NETNS_ETC = Path("/etc/netns")  # per-namespace files that `ip netns exec` mounts over /etc
RESOLVER = "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"


class NoNamespaces(RuntimeError):
    """``ip netns``/veth/``unshare`` is not available or not permitted here."""


HOST = 254  # the host's address on a bridged pair: SUBNET.254


@dataclass(frozen=True)
class Nodes:
    namespaces: tuple[str, str]
    links: tuple[str, str]  # the veth end inside each namespace
    subnet: str = SUBNET
    bridge: str | None = None  # the host's bridge, when bridged

    @property
    def master(self) -> str:
        return self.address(0)

    def address(self, i: int) -> str:
        """Node ``i``'s address (``HOST``: the host's on a bridged pair)."""
        return f"{self.subnet}.{i + 1 if i != HOST else HOST}"

    def link(self, up: bool) -> None:
        """Plug or cut the wire (node 0's end of the veth pair)."""
        _ip("-n", self.namespaces[0], "link", "set", self.links[0], "up" if up else "down")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise NoNamespaces(f"`ip {' '.join(args)}`: {done.stderr.strip() or done.returncode}")


@contextmanager
def two_nodes(subnet: str = SUBNET, bridge: bool = False,
              etc: Mapping[str, str] | None = None) -> Iterator[Nodes]:
    """Two fresh namespaces ``<tag>n0``/``<tag>n1`` wired by a veth pair (``bridge``: each to
    a bridge on the host, which holds ``subnet.254``), addresses ``subnet.1`` and ``.2``,
    ``etc`` (file name -> text) over each one's /etc; removed afterwards."""
    tag = f"pfc{os.getpid() % 100000}"
    nodes = Nodes((f"{tag}n0", f"{tag}n1"), (f"{tag}v0", f"{tag}v1"), subnet,
                  f"{tag}br" if bridge else None)
    made: list[str] = []
    try:
        for ns in nodes.namespaces:
            _ip("netns", "add", ns)
            made.append(ns)
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            for name, text in {"resolv.conf": RESOLVER, **(etc or {})}.items():
                (NETNS_ETC / ns / name).write_text(text)
        if nodes.bridge is None:
            _ip("link", "add", nodes.links[0], "type", "veth", "peer", "name", nodes.links[1])
        else:
            _bridge(nodes)
        for i, (ns, link) in enumerate(zip(nodes.namespaces, nodes.links, strict=True)):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{nodes.address(i)}/24", "dev", link)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", link, "up")
        probe = subprocess.run(["ip", "netns", "exec", nodes.namespaces[0], "unshare", "--uts",
                                "hostname", "localhost"], capture_output=True, text=True)
        if probe.returncode != 0:
            raise NoNamespaces(f"`unshare --uts hostname`: {probe.stderr.strip()}")
        yield nodes
    finally:
        for ns in made:  # deleting a namespace deletes the veth pair of the end inside it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        if nodes.bridge is not None:
            subprocess.run(["ip", "link", "del", nodes.bridge], capture_output=True)


def _bridge(nodes: Nodes) -> None:
    """The host's bridge holding ``subnet.254``, and one veth pair a node: its host end
    (``<tag>h<i>``) on the bridge, its other end (``links[i]``) for the namespace."""
    _ip("link", "add", nodes.bridge, "type", "bridge")
    _ip("addr", "add", f"{nodes.address(HOST)}/24", "dev", nodes.bridge)
    _ip("link", "set", nodes.bridge, "up")
    for i, link in enumerate(nodes.links):
        host_end = f"{nodes.bridge[:-2]}h{i}"
        _ip("link", "add", link, "type", "veth", "peer", "name", host_end)
        _ip("link", "set", host_end, "master", nodes.bridge, "up")


def start_on_node(nodes: Nodes, i: int, cmd: list[str], stdout=subprocess.PIPE,
                  hostname: str = "localhost", **env: str) -> subprocess.Popen:
    """``cmd`` on node ``i`` (its namespace, host name ``hostname``), in its own session,
    output to ``stdout``; W&B off unless ``env`` says otherwise, one thread per rank, no
    interface named for gloo or NCCL (the run must find it itself)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT), **env}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(name, None)
    return subprocess.Popen(["ip", "netns", "exec", nodes.namespaces[i], "unshare", "--uts",
                             "sh", "-c", 'hostname "$0" && exec "$@"', hostname, *cmd],
                            cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def train_on_nodes(nodes: Nodes, data: Path | str, run: Path, *args: str, timeout: float = 180,
                   during: Callable[[list[subprocess.Popen]], None] | None = None,
                   output: str | None = None,
                   env: Callable[[int], dict[str, str]] = lambda rank: {}) -> list[Result]:
    """``launch.train`` on the smoke config as a 2-node job (one rank per node); one
    :class:`Result` per node (both write to ``run``: a file system the nodes share; or to
    ``output``, a store's URL, ``run`` then being node 0's copy of it). ``during(procs)`` runs
    while they train (e.g. to cut the link); ``env(rank)``: node ``rank``'s own variables."""
    procs = [start_on_node(nodes, rank, [
        sys.executable, "-m", "launch.torchrun", "--nnodes", "2", "--node_rank", str(rank),
        "--nproc_per_node", "1", "--max_restarts", "0", "--master_addr", nodes.master,
        "--master_port", str(PORT), "-m", "launch.train", "--config", str(SMOKE),
        f"data.dir={data}", f"output={output or run}", *BASE_ARGS, *args], **env(rank))
        for rank in range(2)]
    if during is not None:
        during(procs)
    results, deadline = [], time.monotonic() + timeout
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            out += f"\n(chaos: killed after {timeout} s)"
        results.append(Result(proc.returncode, out, run))
    return results
