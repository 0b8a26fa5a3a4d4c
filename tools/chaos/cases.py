"""The cases ``python -m tools.chaos`` runs: each breaks one thing and checks the outcome.

A case is a name, what should happen, and a check ``(data, workdir) -> (observed, holds)``
that runs ``launch.train`` through :func:`tools.testbed.harness.train` (subprocesses: one
process, or 2 ranks under torchrun) and reads its exit code, its output and its run folder.
The checks live by the fault they inject: numbers (``numeric``), checkpoints and the disk
(``checkpoints``), signals to ranks (``signals``), bad inputs (``inputs``), the job as a whole
(``jobs``), several nodes (``two_nodes``, ``store_nodes``, ``elastic``) and SLURM
(``tools.slurm.rows``); this table is the one list ``python -m tools.chaos`` and the tests read.
"""

from __future__ import annotations

import re
from pathlib import Path

from tools.chaos.checkpoints import (
    batchnorm_copies_agree,
    bit_flip,
    broken_latest,
    config_drift,
    disk_full,
    kill_in_replace,
    planted_pickle,
    run_folder_fills_up,
)
from tools.chaos.elastic import elastic_case
from tools.chaos.inputs import (
    bad_label,
    corrupt_image_two_epochs,
    duplicate_yaml_key,
    early_checks,
)
from tools.chaos.jobs import launcher_killed, second_job
from tools.chaos.numeric import absurd_scale, diverging_lr, nan_on_one_rank
from tools.chaos.signals import sigterm_one_rank, sigterm_whole_job, stopped_rank
from tools.chaos.store_nodes import store_two_node_case
from tools.chaos.two_nodes import two_node_case
from tools.slurm.rows import SLURM_CASES
from tools.testbed.harness import Case

CASES = [
    Case("optim.lr=1e30 (diverges)", "rc 1, one line after train.max_bad_steps; no NaN "
         "in metrics or checkpoints", diverging_lr),
    Case("NaN loss on rank 1 at step 3 (2 ranks)", "step skipped on both ranks, bad_steps 1, "
         "run completes", nan_on_one_rank),
    Case("margin.s=.inf, optim.lr=1e400", "rc 2 before any process group, keys named",
         absurd_scale),
    Case("pickle planted as .metadata", "refused before unpickling, resumes the previous "
         "checkpoint, payload never runs", planted_pickle),
    Case("400 bytes flipped in a .distcp", "detected, named, previous checkpoint resumed",
         bit_flip),
    Case("kill -9 inside a checkpoint replacement", "restart finds a complete checkpoint",
         kill_in_replace),
    Case("dangling latest, truncated meta.json, stale .tmp", "warned, newest complete resumed, "
         ".tmp removed", broken_latest),
    Case("disk full at the 2nd checkpoint", "rc 1, ENOSPC named, no .tmp left, previous "
         "checkpoint kept", disk_full),
    Case("run folder on a tmpfs filled after a checkpoint", "rc 1, one line naming the "
         "file, latest verifies", run_folder_fills_up),
    Case("SIGTERM to rank 1 only (2 ranks)", "both ranks save after step 5 of 6, the one it "
         "came in, rc 0, says once how to resume; resumed run equals an uninterrupted one",
         sigterm_one_rank),
    Case("SIGTERM to every process of the job (2 ranks, loader workers)", "both trainers "
         "save after step 5 of 6, the one it came in, and say so once, the launch exits 0, "
         "resume equals an uninterrupted run", sigterm_whole_job),
    Case("kill -STOP rank 1 (2 ranks, 10 s collective timeout)", "the run ends with one line "
         "naming the timeout and the step", stopped_rank),
    Case("kill -STOP rank 1, deepspeed (2 ranks, 10 s collective timeout)", "the run ends "
         "with one line naming the timeout and the step",
         lambda data, work: stopped_rank(data, work, "deepspeed")),
    *[Case(f"rank 1 stops in step 3's backward, {engine} (2 ranks, 10 s timeout)", "rank 0 "
           "waits in the gradient reduction; one line after ~10 s naming step 3 and step-2",
           lambda data, work, engine=engine: stopped_rank(data, work, engine, in_backward=True))
      for engine in ("ddp", "deepspeed")],
    *[Case(f"2 nodes x 1 rank on 2 netns, link cut, {engine}", "loss equals 1 node's; the "
           "cut ends both nodes with one line each; the rerun resumes",
           lambda data, work, engine=engine: two_node_case(data, work, engine))
      for engine in ("ddp", "deepspeed")],
    Case("2 nodes x 1 rank on 2 netns sharing no file system: data and run folder on S3, "
         "SIGTERM after step 3", "both nodes save to the store, rc 0; the rerun resumes from "
         "the store, its loss at step 6 equals 1 node's", store_two_node_case),
    Case("elastic 1:2 nodes on 2 netns (make train NNODES=1:2): node 1's launcher killed, "
         "then back", "the survivor resumes alone at accumulation 2, then both at 1; losses "
         "equal an unbroken run's at the same global batch, loader positions equal, one "
         "folder, W&B run and report", elastic_case),
    *SLURM_CASES,
    Case("kill -9 of the launcher (2 ranks, loader workers)", "the ranks save at the next "
         "step and say so; no process of the job left after dist.timeout_s + 30 s",
         launcher_killed),
    Case("the same command twice on one run folder", "the second refused in one line naming "
         "the first, rc 2; the first saves on SIGTERM, rc 0", second_job),
    Case("resume with another margin", "rc 2, one line naming the difference", config_drift),
    Case("label 25 >= num_classes 20", "rc 1, one line naming shard and key", bad_label),
    Case("corrupt JPEG, 2 epochs", "skipped_samples 1, not 2", corrupt_image_two_epochs),
    Case("duplicate YAML key", "rc 2, key and lines named", duplicate_yaml_key),
    Case("batch_size=100000, output under a file", "rc 2 before any process group",
         early_checks),
    Case("BatchNorm statistics (2 ranks)", "backbone.pt equals the DCP copy",
         batchnorm_copies_agree),
]


def run_case(case: Case, data: Path, work: Path) -> tuple[str, bool]:
    """Run one case in its own folder under ``work``; a crash of the check is a failed row."""
    folder = work / re.sub(r"[^A-Za-z0-9]+", "-", case.name).strip("-")  # one per case
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return case.check(data, folder)
    except Exception as exc:  # noqa: BLE001 - reported as an observation
        return f"check crashed: {type(exc).__name__}: {exc}", False


