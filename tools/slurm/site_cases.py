"""``make chaos`` rows that need the site-like cluster (tools/slurm/cluster.py, ``site``): CPU
binding as a GPU site's ``task/affinity`` does it, and a node with a second interface. The
rows of :mod:`tools.slurm.cases` run there too; these check what only such a node shows."""

from __future__ import annotations

from pathlib import Path

from tools.slurm.cases import HOOKS, SCRIPT, ended, same_run, submit, unbroken
from tools.slurm.cluster import NAMES, SITE_CPUS, Cluster
from tools.testbed.harness import ROOT, Result

UNREACHABLE = "172.31.255.1"  # node 0's second address: no other node has a route to it
FIX = ' --cpus-per-task="$CPUS_PER_TASK"'  # the script's srun option under test


def cpu_binding(c: Cluster, data: Path, work: Path) -> tuple[str, bool]:
    """``--gpus-per-node=1 --cpus-per-task=2`` on both nodes with exact steps
    (``SLURM_EXACT=1``: a step gets what it asks, as ``--exact`` and some sites' defaults):
    every rank may run on both CPUs of its node's task and sees one GPU
    (``CUDA_VISIBLE_DEVICES=0``) but trains on the CPU. The same script without the CPUs on
    its srun line binds every rank to one CPU: srun 22.05 does not inherit sbatch's
    ``--cpus-per-task`` (srun(1)). Plain steps (no ``--exact``) got both CPUs either way.
    Where the cluster confines jobs with cgroups (``ConstrainDevices=yes``), a rank opening
    its node's two fake GPU device files gets through to one (ENXIO: no driver serves it)
    and is denied the other (EPERM), as a GPU site's job sees only its gres."""
    text = (ROOT / SCRIPT).read_text()
    unfixed = work / "unfixed.sbatch"
    unfixed.write_text(text.replace(FIX, ""))
    found = {}
    for name, script in (("fixed", SCRIPT), ("unfixed", str(unfixed))):
        folder, run = work / f"affinity-{name}", work / name / "run"
        folder.mkdir(parents=True)
        job = submit(c, data, run, "--nodes=2", steps=2, script=script, PYTHONPATH=str(HOOKS),
                     PFC_AFFINITY_DIR=str(folder), PFC_GPU_DIR=str(c.work), SLURM_EXACT="1")
        state = ended(c, job, 240)
        ranks = {p.name: p.read_text().split("\n")[:3] for p in sorted(folder.iterdir())}
        log = (run / "train.log").read_text() if (run / "train.log").is_file() else ""
        found[name] = (state, ranks, "2 rank(s) on cpu" in log)
    (state, ranks, on_cpu), (_, loose, _) = found["fixed"], found["unfixed"]
    cpus = lambda seen: [len(v[0].split()) for v in seen.values()]  # noqa: E731
    opened = [sorted(d.split(":")[1] for d in v[2].split()) for v in ranks.values()]
    confined = not c.cgroups or opened == [["ENXIO", "EPERM"]] * 2
    return (f"fixed {state}, ranks on cpu {on_cpu}, (CPUs, CUDA_VISIBLE_DEVICES, the GPU "
            f"files opened) a rank {ranks}; devices cgroup {c.cgroups}; without the fix "
            f"{loose}"), \
        FIX in text and state == "COMPLETED" and on_cpu and len(ranks) == 2 \
        and cpus(ranks) == [SITE_CPUS] * 2 and all(v[1] == "0" for v in ranks.values()) \
        and confined and len(loose) == 2 and cpus(loose) == [1, 1]


def master_address(c: Cluster, data: Path, work: Path) -> tuple[str, bool]:
    """Node 0 with a second interface holding an address no other node reaches, listed first
    by ``hostname -I`` (which the script once took): the script gives torchrun node 0's
    address on its route to node 1, and the 2-node run completes with the unbroken run's
    losses."""
    c.add_interface(0, f"{UNREACHABLE}/24")
    listed = c.run("srun", "--nodes=1", f"--nodelist={NAMES[0]}", "hostname", "-I").split()
    reference, run = unbroken(data, work), work / "run"
    job = submit(c, data, run, "--nodes=2")
    state = ended(c, job, 300)
    line = next((ln for ln in (run.parent / f"{job}.out").read_text().splitlines()
                 if ln.startswith("rendezvous on")), "-")
    same, matches = same_run(run, reference)
    world = {r.get("world_size") for r in Result(0, "", run).records() if "loss" in r}
    return (f"hostname -I on {NAMES[0]}: {listed}; {line}; {state}, world sizes "
            f"{sorted(world)}, sacct {c.sacct(job)}; {same}"), \
        listed[:1] == [UNREACHABLE] and line.endswith(f"at {c.nodes.address(0)}:29500") \
        and state == "COMPLETED" and world == {2} and matches
