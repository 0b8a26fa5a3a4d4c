"""Two "nodes" on one machine for the multi-node chaos cases: two network namespaces joined
by a veth pair, one torchrun per namespace (``--nnodes 2 --node_rank i``, one rank each).

Each node runs under ``unshare --uts`` with the hostname ``localhost``, the common cluster
set-up where a node's name resolves to 127.0.0.1: gloo would advertise its loopback address to
the other node, so the run starts only if ``trainer.dist`` picks the veth interface (the one
that routes to ``MASTER_ADDR``). Creating namespaces needs root (CAP_SYS_ADMIN/CAP_NET_ADMIN);
:func:`two_nodes` raises :class:`NoNamespaces` with the reason where that is not permitted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tools.chaos.harness import BASE_ARGS, ROOT, SMOKE, Result

SUBNET = "10.213.7"  # node i has SUBNET.(i+1); node 0 hosts torchrun's store
PORT = 29411


class NoNamespaces(RuntimeError):
    """``ip netns``/veth/``unshare`` is not available or not permitted here."""


@dataclass(frozen=True)
class Nodes:
    namespaces: tuple[str, str]
    links: tuple[str, str]  # the veth end inside each namespace

    @property
    def master(self) -> str:
        return f"{SUBNET}.1"

    def link(self, up: bool) -> None:
        """Plug or cut the wire (node 0's end of the veth pair)."""
        _ip("-n", self.namespaces[0], "link", "set", self.links[0], "up" if up else "down")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise NoNamespaces(f"`ip {' '.join(args)}`: {done.stderr.strip() or done.returncode}")


@contextmanager
def two_nodes() -> Iterator[Nodes]:
    """Two fresh namespaces ``<tag>n0``/``<tag>n1`` wired by a veth pair; removed afterwards."""
    tag = f"pfc{os.getpid() % 100000}"
    nodes = Nodes((f"{tag}n0", f"{tag}n1"), (f"{tag}v0", f"{tag}v1"))
    made: list[str] = []
    try:
        for ns in nodes.namespaces:
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", nodes.links[0], "type", "veth", "peer", "name", nodes.links[1])
        for i, (ns, link) in enumerate(zip(nodes.namespaces, nodes.links, strict=True)):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", link)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", link, "up")
        probe = subprocess.run(["ip", "netns", "exec", nodes.namespaces[0], "unshare", "--uts",
                                "hostname", "localhost"], capture_output=True, text=True)
        if probe.returncode != 0:
            raise NoNamespaces(f"`unshare --uts hostname`: {probe.stderr.strip()}")
        yield nodes
    finally:
        for ns in made:  # deleting a namespace deletes the veth end inside it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def train_on_nodes(nodes: Nodes, data: Path, run: Path, *args: str, timeout: float = 180,
                   during: Callable[[list[subprocess.Popen]], None] | None = None
                   ) -> list[Result]:
    """``launch.train`` on the smoke config as a 2-node job (one rank per node); one
    :class:`Result` per node (both write to ``run``: a file system the nodes share).
    ``during(procs)`` runs while they train (e.g. to cut the link)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(name, None)  # the run must find the interface itself
    procs = []
    for rank, ns in enumerate(nodes.namespaces):
        cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
               'hostname localhost && exec "$@"', "node",
               sys.executable, "-m", "launch.torchrun", "--nnodes", "2",
               "--node_rank", str(rank), "--nproc_per_node", "1", "--max_restarts", "0",
               "--master_addr", nodes.master, "--master_port", str(PORT),
               "-m", "launch.train", "--config", str(SMOKE), f"data.dir={data}",
               f"output={run}", *BASE_ARGS, *args]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
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


def two_node_case(data: Path, work: Path, engine: str) -> tuple[str, bool]:
    """2 nodes x 1 rank: the loss equals a 1-node 2-rank run's at step 6; then a run whose
    link is cut after step 3 for longer than the 10 s timeout ends on both nodes with one
    line each; plugged again, the rerun resumes from the step-2 checkpoint and finishes."""
    from tools.chaos.harness import train, wait_for_step

    try:
        with two_nodes() as nodes:
            two = train_on_nodes(nodes, data, work / "two", f"engine.type={engine}")
            one = train(data, work / "one", f"engine.type={engine}", ranks=2)
            loss = [(r.records() or [{}])[-1].get("loss") for r in (two[0], one)]
            same = None not in loss and abs(loss[0] - loss[1]) <= 1e-5 * abs(loss[1])

            def cut(procs: list[subprocess.Popen]) -> None:
                wait_for_step(work / "cut", 3, procs[0])  # step 2 saved in full
                nodes.link(up=False)

            cut_run = train_on_nodes(nodes, data, work / "cut", f"engine.type={engine}",
                                     "train.max_steps=200", "dist.timeout_s=10", during=cut)
            nodes.link(up=True)
            lines = [[ln for ln in r.out.splitlines() if ln.startswith("error on rank")]
                     for r in cut_run]
            ended = all(r.rc != 0 for r in cut_run) and all(
                len(found) == 1 and "dist.timeout_s=10" in found[0] for found in lines)
            again = train_on_nodes(nodes, data, work / "cut", f"engine.type={engine}",
                                   "train.max_steps=8")
            resumed = all(r.rc == 0 for r in again) and "resumed from" in again[0].out \
                and (again[0].records() or [{}])[-1].get("step") == 8
    except NoNamespaces as err:
        return f"skipped: {err}", True
    return (f"loss at step 6: 2 nodes {loss[0]}, 1 node {loss[1]}; cut: rc "
            f"{[r.rc for r in cut_run]}, lines {[f[0][:60] if f else None for f in lines]}; "
            f"rerun rc {[r.rc for r in again]}, resumed {resumed}"), same and ended and resumed
