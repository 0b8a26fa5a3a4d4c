"""``make chaos``'s SLURM rows (``python -m tools.chaos -k SLURM`` runs them alone); each
row's check is in :mod:`tools.slurm.cases` or :mod:`tools.slurm.site_cases`."""

from __future__ import annotations

from tools.slurm import cases as slurm
from tools.slurm import site_cases as site
from tools.testbed.harness import Case

# scripts/slurm/train.sbatch on a real 2-node SLURM cluster (tools/slurm), the site-like one
# (2 CPUs and 2 fake GPUs a node, task/affinity): each row its own cluster, 1-10 minutes (the
# requeue row waits out SLURM's ~2 min hold on a requeued job; the others lift it)
SLURM_CASES = [Case(f"SLURM: {name}", expected, slurm.on_cluster(check))
               for name, expected, check in [
    ("sbatch --nodes=2", "COMPLETED, 2 ranks, losses equal the unbroken run's, one folder "
     "and W&B id", slurm.two_nodes_complete),
    ("--time=3 --signal=B:USR1@60, a run longer than three", "every notice saves at the next "
     "step and the script requeues the job; COMPLETED after 3+ runs, losses equal",
     slurm.self_requeue),
    ("scontrol requeue", "saved, PENDING, starts again by itself and resumes, losses equal",
     slurm.requeue),
    ("preempted by a job in a higher-priority partition", "saved within GraceTime, requeued, "
     "resumes after the urgent job, losses equal", slurm.preemption),
    ("--nodes=1-2, node 1 lost (link cut, its processes killed)", "NODE_FAIL, requeued, "
     "restarts on 1 node at accumulation 2, losses equal", slurm.lost_node),
    ("scancel", "every rank saves at the next step, CANCELLED; the same sbatch resumes, "
     "losses equal", slurm.cancel),
    ("the same run folder submitted twice", "the second refused in one line, FAILED 2:0; the "
     "first completes", slurm.second_submission),
    ("a bad config key, a data folder without a manifest", "one line each, FAILED 2:0 within "
     "seconds, no rank started", slurm.input_errors),
    ("--cpus-per-task=2, exact steps: every rank's CPUs", "each rank bound to its task's 2 "
     "CPUs, one GPU visible and the other's device denied (cgroups), trains on CPU; without "
     "the script's srun CPUs: 1 CPU",
     site.cpu_binding),
    ("node 0 with an unreachable address listed first by hostname -I", "MASTER_ADDR is node "
     "0's address on its route to node 1; COMPLETED, losses equal", site.master_address),
]]
