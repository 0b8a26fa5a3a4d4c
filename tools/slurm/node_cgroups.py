"""cgroup v1 for a namespaced node's slurmd (tools/slurm/cluster.py, the site-like cluster):
``ip netns exec`` mounts a fresh /sys without the host's cgroup hierarchies, so each node's
slurmd starts behind mounts of its own: each hierarchy's folder ``<namespace>`` bound over
/sys/fs/cgroup/<controller>, the node's whole cgroup tree as it sees it (two slurmds sharing
one tree would share a job's cgroups, and proctrack/cgroup would signal the other node's
processes), removed when the cluster stops. Only ``cpuset``, ``devices`` and ``freezer``:
``ConstrainCores``, ``ConstrainDevices`` and proctrack/cgroup need no more, and the memory
hierarchy would move the jobs out of the memory cgroup this machine's processes run in."""

from __future__ import annotations

import contextlib
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUPS = ("cpuset", "devices", "freezer")


def available() -> bool:
    """Whether the host has the cgroup v1 hierarchies task/cgroup and proctrack/cgroup need."""
    return all((CGROUP_ROOT / c / "cgroup.procs").is_file() for c in CGROUPS)


def mounts(work: Path, ns: str) -> str:
    """sh commands, run in node ``ns``'s mount namespace before its slurmd: each hierarchy of
    :data:`CGROUPS` mounted under ``work``, its folder ``ns`` made (a cpuset given the root's
    CPUs and memory nodes) and bound over /sys/fs/cgroup/<controller>."""
    lines = ["mount -t tmpfs cgroups /sys/fs/cgroup"]
    for c in CGROUPS:
        own = f"{work}/cgroup-{ns}/{c}"
        lines += [f"mkdir -p {own} /sys/fs/cgroup/{c}", f"mount -t cgroup -o {c} cgroup {own}",
                  f"mkdir -p {own}/{ns}"]
        if c == "cpuset":
            lines += [f"cat {own}/cpuset.{k} > {own}/{ns}/cpuset.{k}" for k in ("cpus", "mems")]
        lines.append(f"mount --bind {own}/{ns} /sys/fs/cgroup/{c}")
    return " && ".join(lines) + ' && exec "$@"'


def remove(ns: str) -> None:
    """The node's cgroup folders, deepest first (SLURM leaves its own, emptied)."""
    for c in CGROUPS:
        top = CGROUP_ROOT / c / ns
        for folder in sorted((p for p in [top, *top.rglob("*")] if p.is_dir()),
                             key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                folder.rmdir()
