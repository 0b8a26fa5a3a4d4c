"""scripts/slurm/train.sbatch under a real SLURM cluster (tools/slurm): the cheap checks here
run in ``make test``; two of ``make chaos``'s SLURM rows run end to end in ``make test-long``
(a cluster of two network namespaces, as root, with Debian's slurm-wlm and munge), the
others in ``make chaos`` only (1-7 minutes each)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tools.slurm import cases as slurm_cases
from tools.slurm import cluster as slurm_cluster
from tools.testbed.nodes import Nodes

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm" / "train.sbatch"
LONG_ROWS = ["SLURM: sbatch --nodes=2",
             "SLURM: a bad config key, a data folder without a manifest"]
CHAOS_ONLY = ["SLURM: --time=3 --signal=B:USR1@60, a run longer than three",
              "SLURM: scontrol requeue",
              "SLURM: preempted by a job in a higher-priority partition",
              "SLURM: --nodes=1-2, node 1 lost (link cut, its processes killed)",
              "SLURM: scancel",
              "SLURM: the same run folder submitted twice",
              "SLURM: --cpus-per-task=2, exact steps: every rank's CPUs",
              "SLURM: node 0 with an unreachable address listed first by hostname -I"]


def test_the_site_like_cluster_declares_cpus_gpus_and_binding(tmp_path):
    nodes = Nodes(("a", "b"), ("va", "vb"), "10.1.2", "br")
    lines = slurm_cluster.slurm_conf(tmp_path, nodes, site=True).splitlines()
    for expected in ("TaskPlugin=task/affinity", "GresTypes=gpu",
                     "SlurmdParameters=config_overrides",
                     "NodeName=pfc-n0 NodeAddr=10.1.2.1 CPUs=2 Gres=gpu:2 State=UNKNOWN"):
        assert expected in lines
    confined = slurm_cluster.slurm_conf(tmp_path, nodes, site=True, cgroups=True).splitlines()
    assert {"ProctrackType=proctrack/cgroup", "TaskPlugin=task/cgroup,task/affinity"} \
        <= set(confined)
    gres = slurm_cluster.gres_conf(tmp_path).splitlines()
    assert gres[0] == "AutoDetect=off"
    assert f"NodeName=pfc-n1 Name=gpu File={tmp_path}/dev-pfc-n1/nvidia[0-1]" in gres


def test_slurm_conf_declares_two_nodes_two_partitions_and_job_states():
    nodes = Nodes(("a", "b"), ("va", "vb"), "10.1.2", "br")
    lines = slurm_cluster.slurm_conf(Path("/w"), nodes).splitlines()
    for expected in ("PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
                     "AccountingStorageType=accounting_storage/none",
                     "JobCompType=jobcomp/filetxt", "JobCompLoc=/w/jobcomp.txt",
                     "NodeName=pfc-n0 NodeAddr=10.1.2.1 CPUs=1 State=UNKNOWN",
                     "NodeName=pfc-n1 NodeAddr=10.1.2.2 CPUs=1 State=UNKNOWN"):
        assert expected in lines
    assert any(ln.endswith("(10.1.2.254)") and ln.startswith("SlurmctldHost=") for ln in lines)
    parts = {ln.split()[0]: ln for ln in lines if ln.startswith("PartitionName=")}
    assert "PriorityTier=1 " in parts["PartitionName=batch"]
    assert f"GraceTime={slurm_cluster.GRACE_S}" in parts["PartitionName=batch"]
    assert "PriorityTier=10 " in parts["PartitionName=urgent"]


def test_without_root_the_slurm_rows_skip_saying_how_in_one_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(slurm_cluster.NoSlurm) as err:
        slurm_cluster.ensure_installed()
    assert "\n" not in str(err.value)
    assert "apt-get install -y slurm-wlm munge" in str(err.value)


def _script_lines(starts: tuple[str, ...], show: str, **env: str) -> str:
    """The script's lines that start with ``starts``, run by bash with ``env`` as SLURM
    exports it; what ``echo show`` then prints."""
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    lines = [ln for ln in SCRIPT.read_text().splitlines() if ln.startswith(starts)]
    assert len(lines) == len(starts)
    done = subprocess.run(["bash", "-c", "\n".join([*lines, f'echo "{show}"'])],
                          env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize(("env", "ranks"), [
    ({"SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_ON_NODE": "64"}, "8"),
    ({"SLURM_CPUS_ON_NODE": "4"}, "4"),
    ({"SLURM_GPUS_ON_NODE": "0", "SLURM_CPUS_ON_NODE": "4"}, "4"),
    ({"NPROC_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_ON_NODE": "64"}, "2"),
])
def test_the_script_takes_its_ranks_per_node_from_the_allocation(env, ranks):
    """GPUs (gres) first, then CPUs: what SLURM exports on a GPU node, a CPU-only node (no
    variable, or 0 under --gpus-per-node=0) and under an explicit NPROC_PER_NODE."""
    assert _script_lines(("GPUS=", "export NPROC_PER_NODE="), "$NPROC_PER_NODE", **env) == ranks


@pytest.mark.parametrize(("per_node", "cpus"), [("2(x2)", "2"), ("64", "64"),
                                                ("72,36(x3)", "36")])
def test_each_nodes_task_asks_srun_for_the_jobs_cpus_there(per_node, cpus):
    """srun 22.05 does not inherit sbatch's --cpus-per-task (srun(1)): the script gives the
    training step the job's CPUs a node (the fewest of any node) on srun's command line."""
    assert _script_lines(("CPUS_PER_TASK=",), "$CPUS_PER_TASK",
                         SLURM_JOB_CPUS_PER_NODE=per_node) == cpus
    assert '--cpus-per-task="$CPUS_PER_TASK"' in SCRIPT.read_text()


def test_every_slurm_row_runs_in_make_test_long_or_make_chaos():
    from tools.slurm.rows import SLURM_CASES

    assert sorted(c.name for c in SLURM_CASES) == sorted([*LONG_ROWS, *CHAOS_ONLY])


@pytest.fixture(scope="module")
def chaos_data(tmp_path_factory):
    from tools.testbed.harness import write_data

    return write_data(tmp_path_factory.mktemp("chaos") / "data")


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("name", LONG_ROWS)
def test_slurm_row_holds(name, chaos_data, tmp_path):
    """The row on a fresh 2-node cluster; skipped in one line where SLURM cannot run."""
    from tools.chaos.cases import SLURM_CASES, run_case

    (case,) = [c for c in SLURM_CASES if c.name == name]
    observed, holds = run_case(case, chaos_data, tmp_path)
    if observed.startswith("skipped: "):
        pytest.skip(observed)
    assert holds, f"{name}: expected {case.expected}; observed {observed}"


def test_a_row_whose_cluster_did_not_start_fails_and_one_that_cannot_run_skips(monkeypatch,
                                                                               tmp_path):
    """A missing SLURM is a skip; a daemon that did not come up is the row's failure, named
    (it used to read as a skip that holds, hiding a slurm.conf the project broke)."""
    from contextlib import contextmanager

    def cluster_raising(error):
        @contextmanager
        def cluster(*args, **kwargs):
            raise error
            yield
        return cluster

    def check(*args):
        raise AssertionError("the check runs only on a started cluster")

    monkeypatch.setattr(slurm_cases, "cluster", cluster_raising(
        slurm_cluster.ClusterDidNotStart("both nodes idle: not after 60 s (slurmctld.log: x)")))
    observed, holds = slurm_cases.on_cluster(check)(tmp_path, tmp_path)
    assert not holds and observed.startswith("the cluster did not start: both nodes idle")
    shutil.rmtree(observed.rsplit("its logs: ", 1)[1])
    monkeypatch.setattr(slurm_cases, "cluster", cluster_raising(slurm_cluster.NoSlurm("not root")))
    observed, holds = slurm_cases.on_cluster(check)(tmp_path, tmp_path)
    assert holds and observed == "skipped: not root"


def _script_end(tmp_path: Path, job: str, output: str | None, notice: bool, seen: int = 0,
                run: int = 0) -> tuple[str, int]:
    """The script's ``requeue`` and its last block (from the preemption check to ``exit``),
    run by bash with a ``scontrol`` that prints ``job`` and records a requeue, the job's
    output file holding ``output`` (``None``: unreadable), ``seen`` bytes of it older than
    this run; what it printed, its exit status (the trainers exited 7)."""
    text = SCRIPT.read_text()
    start, end = text.index("requeue() {"), text.index("\n}\n", text.index("requeue() {")) + 3
    last = text[text.index("if scontrol show job"):]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/bash\nif [ "$1" = requeue ]; then echo "scontrol requeue $2"\n'
                        f'else echo "{job}"; fi\n')
    scontrol.chmod(0o755)
    out = tmp_path / "job.out"
    if output is not None:
        out.write_text(output)
    head = (f"set -uo pipefail\nRUN={run}\nSTATUS=7\nSEEN={seen}\nOUTPUT={out}\n"
            f"NOTICE={'now' if notice else ''}\nSLURM_JOB_ID=42\n")
    done = subprocess.run(["bash", "-c", head + text[start:end] + last], capture_output=True,
                          text=True, env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    return done.stdout + done.stderr, done.returncode


STOPPED = "rank 0: stopped by SIGUSR1 after step 12, saved\n"


@pytest.mark.parametrize(("case", "job", "output", "notice", "seen", "requeued"), [
    ("stopped at the notice", "JobState=RUNNING", "log\n" + STOPPED, True, 0, "time limit"),
    ("reached its last step first", "JobState=RUNNING", "log\ndone\n", True, 0, None),
    ("only an earlier run's line", "JobState=RUNNING", STOPPED + "log\n", True,
     len(STOPPED), None),
    ("an output the script cannot read", "JobState=RUNNING", None, True, 0, "time limit"),
    ("no notice", "JobState=RUNNING", STOPPED, False, 0, None),
    ("preempted, whatever the exit", "PreemptTime=2026-12-07T13:00:00", "", False, 0,
     "preempted"),
    ("a long output after the line (grep -q would SIGPIPE tail)", "JobState=RUNNING",
     STOPPED + ("y" * 79 + "\n") * 40_000, True, 0, "time limit"),
])
def test_the_script_requeues_at_the_end_only_for_a_stop_it_can_see(tmp_path, case, job, output,
                                                                    notice, seen, requeued):
    """The end of scripts/slurm/train.sbatch: a time-limit notice requeues the job only when
    rank 0 printed "stopped by SIGUSR1" in this run's part of the output (a run that reached
    its last step is done); a preempted job is requeued whatever the trainers exited with; the
    trainers' exit status is the script's."""
    said, status = _script_end(tmp_path, job, output, notice, seen)
    assert status == 7, said
    if requeued is None:
        assert "requeue" not in said, said
    else:
        assert said.splitlines() == [f"{requeued}: requeueing job 42 (run 1 next)",
                                     "scontrol requeue 42"], said


def test_the_script_stops_requeueing_at_max_requeues(tmp_path):
    said, status = _script_end(tmp_path, "PreemptTime=2026-12-07T13:00:00", "", False, run=20)
    assert status == 7 and "scontrol requeue" not in said
    assert said.startswith("preempted: not requeued, job 42 has run 21 times (MAX_REQUEUES=20)")
