"""``make chaos``'s SLURM rows (``python -m tools.chaos -k SLURM`` runs them alone); each
row's check is in :mod:`tools.slurm.cases`."""

from __future__ import annotations

from tools.chaos.harness import Case
from tools.slurm import cases as slurm

# scripts/slurm/train.sbatch on a real 2-node SLURM cluster (tools/slurm): each row its own
# cluster, 1-5 minutes (a requeued job waits ~2 min for SLURM to start it again)
SLURM_CASES = [Case(f"SLURM: {name}", expected, slurm.on_cluster(check))
               for name, expected, check in [
    ("sbatch --nodes=2", "COMPLETED, 2 ranks, losses equal the unbroken run's, one folder "
     "and W&B id", slurm.two_nodes_complete),
    ("--time=4 --signal=B:USR1@60, then the same sbatch", "every rank saves at the next "
     "step, COMPLETED; the resubmission resumes there, losses equal", slurm.time_limit),
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
]]
