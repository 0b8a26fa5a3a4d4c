"""A real two-node SLURM cluster on this machine: munge with a key of its own, slurmctld on the
host side, one slurmd in each of two network namespaces (``tools.testbed.nodes``, bridged to the
host), each with its own host name (a UTS namespace) and address.

What it declares, and why:

- **Nodes** ``pfc-n0`` (``10.213.8.1``) and ``pfc-n1`` (``.2``), **one CPU each**: the
  machine's cores split between the two nodes (slurmd sees every core of the host; a node
  declaring fewer CPUs than it has is accepted as is). A job gets one CPU a node, and the
  training script runs one rank a CPU on a CPU-only allocation.
- **Partitions** ``batch`` (the default, ``PriorityTier=1``, ``GraceTime``) and ``urgent``
  (``PriorityTier=10``): a job in ``urgent`` preempts one in ``batch``
  (``PreemptType=preempt/partition_prio``, ``PreemptMode=REQUEUE``).
- **Job states without slurmdbd**: ``AccountingStorageType=accounting_storage/none`` (Debian's
  22.05 ships the ``none`` and ``slurmdbd`` accounting plugins only: sacct's accounting needs
  slurmdbd and a database) and ``JobCompType=jobcomp/filetxt``: one line a job each time it
  ends, requeues included, which ``sacct --completion`` reads (:meth:`Cluster.sacct`).
- ``cgroup.conf`` names ``cgroup/v1``: slurmd loads a cgroup plugin whatever the others say,
  and in a namespace's own /sys nothing is mounted where it would detect the version.
- ``SlurmdTimeout`` short (a lost node is DOWN within seconds, not the default 5 minutes),
  ``ReturnToService=2`` (a node back is usable at once), ``proctrack/linuxproc`` and
  ``task/none``: no cgroups needed.

``site=True`` declares the cluster as GPU sites run theirs: **two CPUs and two GPUs a node**
(``CPUs=2`` and ``Gres=gpu:2``; ``SlurmdParameters=config_overrides`` lets a node claim what
the machine has not), ``TaskPlugin=task/affinity`` (every task bound to the CPUs it was
given: a step that asks for fewer CPUs than the job has gets fewer) and ``GresTypes=gpu``
with two device files a node that the cluster creates under its folder, named in
``gres.conf`` with ``AutoDetect=off``: ``--gpus-per-node=N`` sets ``SLURM_GPUS_ON_NODE`` and
``CUDA_VISIBLE_DEVICES`` as on a GPU node, while torch, seeing no CUDA, trains on the CPU.
Where the host has cgroup v1's ``cpuset``, ``devices`` and ``freezer`` hierarchies (this
sandbox: cgroup v2 is mounted beside them holding no controller but hugetlb, so SLURM's
``cgroup/v2`` cannot run), the site-like cluster also confines jobs as most sites do:
``TaskPlugin=task/cgroup,task/affinity``, ``ProctrackType=proctrack/cgroup``,
``ConstrainCores`` and ``ConstrainDevices``. ``ip netns exec`` mounts a fresh /sys without
them, so each node's slurmd starts behind mounts of its own (:mod:`tools.slurm.node_cgroups`).
Elsewhere (a host of cgroup v2 only) the site-like cluster binds with ``task/affinity`` alone.

Everything lives in one work folder (config, key, sockets, state, logs); nothing under /etc
but the namespaces' own files (``/etc/netns``). Needs root (namespaces, daemons as root) and
Debian's ``slurm-wlm`` and ``munge`` (:func:`ensure_installed`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tools.slurm import node_cgroups
from tools.testbed.harness import ROOT
from tools.testbed.nodes import HOST, Nodes, NoNamespaces, start_on_node, two_nodes

# Cluster k (up to SLOTS on a machine at once, one per process: tools.testbed.nodes names the
# namespaces by pid) has the subnet 10.213.(8+k) and slurmctld's port CTLD_PORT + k: not
# tools.testbed.nodes's subnet, since the host holds .254 of it here.
SLOTS = 3
NAMES = ("pfc-n0", "pfc-n1")
CTLD_PORT, SLURMD_PORT = 6917, 6918
GRACE_S = 30  # partition batch's GraceTime: a preempted job's time to save
KILL_WAIT_S = 30  # SIGTERM to SIGKILL when a job is cancelled or its time is up
SLURMD_TIMEOUT_S = 10  # a node silent this long is DOWN
SITE_CPUS, SITE_GPUS = 2, 2  # a site-like node's (cluster(site=True))
NVIDIA_MAJOR = 195
PACKAGES = ("slurm-wlm", "munge")
LOCK = "/tmp/pfc-slurm-{}.lock"
HOW = "needs root and Debian's slurm-wlm and munge (as root: apt-get install -y slurm-wlm munge)"


class NoSlurm(RuntimeError):
    """SLURM cannot run here (not root, not installable, no network namespaces): a row is
    skipped; the message says why and how to get it, in one line."""


class ClusterDidNotStart(RuntimeError):
    """SLURM is here but a daemon did not come up (munged, slurmctld, a slurmd): the row
    fails, naming the daemon and its log's last lines. Not a skip: a configuration this
    project writes that stops the cluster is a failure of the project."""


def ensure_installed(install: bool = True) -> None:
    """slurmctld, slurmd and munged present; installed with apt-get where absent and the user
    is root (``install``). Raises :class:`NoSlurm` otherwise."""
    if os.geteuid() != 0:
        raise NoSlurm(f"not root: {HOW}")
    if all(shutil.which(p) for p in ("slurmctld", "slurmd", "munged", "sbatch")):
        return
    if not install or shutil.which("apt-get") is None:
        raise NoSlurm(f"slurm-wlm or munge missing: {HOW}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # A fresh machine (a CI image) may hold no package lists yet: fetched once, then retried.
    for first in ((), ("apt-get", "update", "-q")):
        if first:
            subprocess.run(first, capture_output=True, env=env)
        done = subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES],
                              capture_output=True, text=True, env=env)
        if done.returncode == 0:
            return
    raise NoSlurm(f"apt-get install {' '.join(PACKAGES)} failed: "
                  f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")


def slurm_conf(work: Path, nodes: Nodes, ctld_port: int = CTLD_PORT, site: bool = False,
               cgroups: bool = False) -> str:
    """slurm.conf for the two namespaces, everything under ``work``; ``site``: two CPUs, two
    GPUs and CPU binding a node, ``cgroups``: with cgroup v1 (the module's docstring)."""
    node = f"CPUs={SITE_CPUS} Gres=gpu:{SITE_GPUS}" if site else "CPUs=1"
    tasks = ("ProctrackType=proctrack/cgroup", "TaskPlugin=task/cgroup,task/affinity") \
        if site and cgroups else ("ProctrackType=proctrack/linuxproc",
                                  f"TaskPlugin=task/{'affinity' if site else 'none'}")
    host = socket.gethostname().split(".")[0]
    lines = [
        "ClusterName=partialfc",
        f"SlurmctldHost={host}({nodes.address(HOST)})",
        f"SlurmctldPort={ctld_port}", f"SlurmdPort={SLURMD_PORT}",
        "AuthType=auth/munge", "CryptoType=crypto/munge", f"AuthInfo=socket={work}/munge.sock",
        "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={work}/ctld", f"SlurmdSpoolDir={work}/spool-%n",
        f"SlurmctldPidFile={work}/slurmctld.pid", f"SlurmdPidFile={work}/slurmd-%n.pid",
        f"SlurmctldLogFile={work}/slurmctld.log", f"SlurmdLogFile={work}/slurmd-%n.log",
        *tasks, *(("GresTypes=gpu", "SlurmdParameters=config_overrides") if site else ()),
        "JobAcctGatherType=jobacct_gather/none", "MpiDefault=none", "SwitchType=switch/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "ReturnToService=2", f"SlurmdTimeout={SLURMD_TIMEOUT_S}", "InactiveLimit=0",
        f"KillWait={KILL_WAIT_S}", "MinJobAge=600", "MessageTimeout=10",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt", f"JobCompLoc={work}/jobcomp.txt",
        "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
        *(f"NodeName={name} NodeAddr={nodes.address(i)} {node} State=UNKNOWN"
          for i, name in enumerate(NAMES)),
        f"PartitionName=batch Nodes=ALL Default=YES PriorityTier=1 GraceTime={GRACE_S} "
        "MaxTime=INFINITE State=UP",
        "PartitionName=urgent Nodes=ALL PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def gres_conf(work: Path) -> str:
    """gres.conf of a site-like cluster: each node's fake GPUs, no detection (no NVML)."""
    return "AutoDetect=off\n" + "".join(
        f"NodeName={name} Name=gpu File={gpu_files(work, name)}\n" for name in NAMES)


def gpu_files(work: Path, name: str) -> str:
    """Node ``name``'s GPU device files, as gres.conf names them (``.../nvidia[0-1]``)."""
    return f"{work}/dev-{name}/nvidia[0-{SITE_GPUS - 1}]"


def _make_gpus(work: Path) -> None:
    """The fake GPUs' device files: character devices of NVIDIA's major number, which no
    driver here serves (a plain file where mknod is not permitted)."""
    for name in NAMES:
        (work / f"dev-{name}").mkdir(exist_ok=True)
        for i in range(SITE_GPUS):
            path = work / f"dev-{name}" / f"nvidia{i}"
            try:
                os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, i))
            except PermissionError:
                path.touch()


def hosts_file(subnet: str) -> str:
    """The namespaces' /etc/hosts: each node's name to its address (as on a cluster)."""
    return "127.0.0.1 localhost\n" + "".join(
        f"{subnet}.{i + 1} {name}\n" for i, name in enumerate(NAMES))


@dataclass
class Cluster:
    """A running cluster: ``env`` for the clients (``SLURM_CONF``), its folder, its nodes."""

    work: Path
    nodes: Nodes
    slurmds: list[subprocess.Popen | None]
    site: bool = False  # the site-like cluster (slurm_conf)
    cgroups: bool = False  # ... confining jobs with cgroup v1

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.work / "slurm.conf")}

    def run(self, *cmd: str, check: bool = True, **env: str) -> str:
        """A SLURM client command (sbatch, squeue, scontrol, ...) on the host; its stdout."""
        done = subprocess.run(cmd, capture_output=True, text=True, env={**self.env, **env},
                              timeout=60, cwd=ROOT)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: rc {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, *args: str, **env: str) -> int:
        """``sbatch --parsable ARGS`` (from the repository root, as every command here); the
        job id."""
        return int(self.run("sbatch", "--parsable", *args, **env).strip().split(";")[0])

    def state(self, job: int) -> str:
        """The job's state as slurmctld holds it (``scontrol show job``), '' once purged."""
        out = self.run("scontrol", "-o", "show", "job", str(job), check=False)
        return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "")

    def sacct(self, job: int) -> list[str]:
        """Every state ``sacct --completion`` has for the job, oldest first (one a time it
        ended: a requeued job ends more than once)."""
        out = self.run("sacct", "--completion", "-j", str(job), "-n", "-P", "-o", "State,ExitCode",
                       check=False)
        return [line for line in out.splitlines() if line.strip()]

    def wait_state(self, job: int, states: tuple[str, ...], limit: float) -> str:
        """Poll until the job is in one of ``states`` (or ``limit`` s pass); the last state."""
        deadline, state = time.monotonic() + limit, ""
        while time.monotonic() < deadline:
            state = self.state(job)
            if state in states:
                break
            time.sleep(0.5)
        return state

    def node_pids(self, i: int) -> list[int]:
        """Every process in node ``i``'s network namespace: slurmd, its steps, the job's."""
        out = subprocess.run(["ip", "netns", "pids", self.nodes.namespaces[i]],
                             capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def lose_node(self, i: int) -> None:
        """Node ``i`` lost as a machine is: its link cut (its peers see no reset), then
        every process on it killed."""
        _ip_link(self.nodes, i, up=False)
        for pid in self.node_pids(i):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.slurmds[i] is not None:
            self.slurmds[i].wait()
            self.slurmds[i] = None

    def add_interface(self, i: int, address: str) -> None:
        """A second interface on node ``i`` holding ``address`` (``a.b.c.d/n``), which no other
        node reaches (as docker0 or a management network): a veth pair with both ends on the
        node, made after the node's link and so numbered before it (its own namespace counts
        from 2), so that ``hostname -I`` lists it first."""
        ns = self.nodes.namespaces[i]
        for args in (("link", "add", "pfcx0", "type", "veth", "peer", "name", "pfcx1"),
                     ("addr", "add", address, "dev", "pfcx0"), ("link", "set", "pfcx0", "up"),
                     ("link", "set", "pfcx1", "up")):
            subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True)

    def restore_node(self, i: int) -> None:
        """Node ``i`` back: its link up, its slurmd started again."""
        _ip_link(self.nodes, i, up=True)
        self.slurmds[i] = _slurmd(self.work, self.nodes, i, self.cgroups)


def _ip_link(nodes: Nodes, i: int, up: bool) -> None:
    subprocess.run(["ip", "-n", nodes.namespaces[i], "link", "set", nodes.links[i],
                    "up" if up else "down"], check=True)


def _slurmd(work: Path, nodes: Nodes, i: int, cgroups: bool) -> subprocess.Popen:
    cmd = ["slurmd", "-D", "-f", str(work / "slurm.conf")]
    if cgroups:
        cmd = ["sh", "-c", node_cgroups.mounts(work, nodes.namespaces[i]), "sh", *cmd]
    with open(work / f"slurmd-{NAMES[i]}.out", "a") as out:
        return start_on_node(nodes, i, cmd, stdout=out, hostname=NAMES[i])


def _munged(work: Path) -> subprocess.Popen:
    key = work / "munge.key"
    subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True,
                   capture_output=True)
    key.chmod(0o600)
    return subprocess.Popen(["munged", "--foreground", "--force", f"--key-file={key}",
                             f"--socket={work}/munge.sock", f"--pid-file={work}/munged.pid",
                             f"--log-file={work}/munged.log", f"--seed-file={work}/munged.seed"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


@contextmanager
def cluster(work: Path | None = None, keep: bool = False, site: bool = False
            ) -> Iterator[Cluster]:
    """Start munged, slurmctld and two slurmds, wait until both nodes are idle, yield the
    :class:`Cluster` (``site``: the site-like one, :func:`slurm_conf`); stop them all and
    remove the namespaces (and ``work`` unless ``keep``) afterwards. Raises
    :class:`NoSlurm` where SLURM or namespaces are not available, and
    :class:`ClusterDidNotStart` where they are but a daemon did not come up."""
    ensure_installed()
    slot, hold = _slot()
    subnet = f"10.213.{8 + slot}"
    work = Path(work or tempfile.mkdtemp(prefix="pfc-slurm-"))
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o700)  # munged refuses a key or socket in a folder others may write
    daemons: list[subprocess.Popen] = []
    made: Nodes | None = None
    try:
        with two_nodes(subnet, bridge=True, etc={"hosts": hosts_file(subnet)}) as nodes:
            made = nodes
            cgroups = site and node_cgroups.available()
            (work / "slurm.conf").write_text(slurm_conf(work, nodes, CTLD_PORT + slot, site,
                                                        cgroups))
            if site:
                _make_gpus(work)
                (work / "gres.conf").write_text(gres_conf(work))
            (work / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n" + (
                "ConstrainCores=yes\nConstrainDevices=yes\n" if cgroups else ""))
            for name in NAMES:
                (work / f"spool-{name}").mkdir(exist_ok=True)
            daemons.append(_munged(work))
            _wait_for(lambda: (work / "munge.sock").exists(), 10, "munged", work / "munged.log",
                      tuple(daemons))
            daemons.append(subprocess.Popen(
                ["slurmctld", "-D", "-c", "-i", "-f", str(work / "slurm.conf")],
                stdout=open(work / "slurmctld.out", "w"), stderr=subprocess.STDOUT))
            found = Cluster(work, nodes, [_slurmd(work, nodes, i, cgroups) for i in range(2)],
                            site, cgroups)
            try:
                _wait_for(lambda: found.run("sinfo", "-h", "-N", "-p", "batch", "-o", "%t",
                                            check=False).split() == ["idle"] * 2, 60,
                          "both nodes idle", work / "slurmctld.log",
                          (*daemons, *found.slurmds))
                yield found
            finally:
                for proc in found.slurmds:
                    if proc is not None:
                        proc.terminate()
                        _stop(proc)
                for ns in nodes.namespaces if cgroups else ():
                    node_cgroups.remove(ns)
    except NoNamespaces as err:
        raise NoSlurm(f"no network namespaces: {err}") from err
    finally:
        for proc in reversed(daemons):
            proc.terminate()
            _stop(proc)
        if made is not None:
            _links_gone(made)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
        hold.close()


def _links_gone(nodes: Nodes, limit: float = 5) -> None:
    """The nodes' veth pairs gone once their namespaces are: after the lost-node row a host
    end outlived its namespace's deletion by more than 30 s, and the next cluster of this
    process, whose links have the same names, was refused ('File exists'). Waited for
    ``limit`` s, then deleted (a pair goes with its host end)."""
    ends = [f"{nodes.bridge[:-2]}h{i}" for i in range(2)] if nodes.bridge else []
    left = lambda: [e for e in ends if subprocess.run(  # noqa: E731
        ["ip", "link", "show", "dev", e], capture_output=True).returncode == 0]
    deadline = time.monotonic() + limit
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    for end in left():
        subprocess.run(["ip", "link", "del", "dev", end], capture_output=True)


def _slot() -> tuple[int, IO]:
    """A free cluster slot and its lock (held for the cluster's life); with every slot
    taken, wait for the first."""
    for slot in range(SLOTS):
        hold = open(LOCK.format(slot), "w")  # noqa: SIM115 - closed when the cluster stops
        try:
            fcntl.flock(hold, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return slot, hold
        except BlockingIOError:
            hold.close()
    hold = open(LOCK.format(0), "w")  # noqa: SIM115
    fcntl.flock(hold, fcntl.LOCK_EX)
    return 0, hold


def _stop(proc: subprocess.Popen, limit: float = 15) -> None:
    try:
        proc.wait(limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_for(done, limit: float, what: str, log: Path,
              daemons: tuple[subprocess.Popen, ...] = ()) -> None:
    """Poll ``done()`` until it holds; :class:`ClusterDidNotStart` with ``log``'s last lines
    after ``limit`` s or once one of ``daemons`` has ended."""
    deadline = time.monotonic() + limit
    while not done():
        if time.monotonic() > deadline or any(d.poll() is not None for d in daemons):
            tail = log.read_text().splitlines()[-5:] if log.is_file() else []
            raise ClusterDidNotStart(f"{what}: not after {limit:.0f} s ({log}: {' | '.join(tail)})")
        time.sleep(0.5)
