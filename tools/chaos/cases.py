"""The cases ``python -m tools.chaos`` runs: each breaks one thing and checks the outcome.

A case is a name, what should happen, and a check ``(data, workdir) -> (observed, holds)``
that runs ``launch.train`` through :func:`tools.chaos.harness.train` (subprocesses: one process, or
2 ranks under torchrun) and reads its exit code, its output and its run folder.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tools.chaos.elastic import elastic_case
from tools.chaos.harness import (
    ROOT,
    SMOKE,
    STEPS,
    Result,
    signal_job,
    train,
    wait_for_step,
    wait_until,
    while_held,
    worker_pids,
    write_data,
)
from tools.chaos.jobs import launcher_killed, second_job
from tools.chaos.nodes import two_node_case
from tools.chaos.store_nodes import store_two_node_case
from tools.slurm import cases as slurm


@dataclass(frozen=True)
class Case:
    name: str
    expected: str
    check: Callable[[Path, Path], tuple[str, bool]]  # (data, workdir) -> (observed, holds)


def _finite_checkpoints(run: Path) -> bool:
    import torch

    for folder in (run / "checkpoints").glob("step-*"):
        state = torch.load(folder / "backbone.pt", weights_only=True)
        if not all(bool(v.isfinite().all()) for v in state.values() if v.is_floating_point()):
            return False
    return True


def diverging_lr(data: Path, work: Path) -> tuple[str, bool]:
    r = train(data, work / "run", "optim.lr=1e30", "train.max_bad_steps=3")
    errors = r.errors()
    nulls = sum(1 for rec in r.records() if "loss" in rec and rec["loss"] is None)
    holds = (r.rc == 1 and len(errors) == 1 and "3 steps in a row" in errors[0]
             and nulls == 3 and _finite_checkpoints(r.run))
    return f"rc {r.rc}, {len(errors)} error line(s), {nulls} null losses, checkpoints finite: " \
           f"{_finite_checkpoints(r.run)}", holds


def nan_on_one_rank(data: Path, work: Path) -> tuple[str, bool]:
    r = train(data, work / "run", ranks=2, inject=["nan-rank1-step3"])
    last = (r.records() or [{}])[-1]
    skipped = r.out.count("skipped on every rank")
    holds = r.rc == 0 and last.get("bad_steps") == 1 and last.get("step") == STEPS
    return f"rc {r.rc}, bad_steps {last.get('bad_steps')}, {skipped} skip line(s), " \
           f"reached step {last.get('step')}", holds and skipped == 1


def absurd_scale(data: Path, work: Path) -> tuple[str, bool]:
    r = train(data, work / "run", "margin.s=.inf", "optim.lr=1e400")
    lines = [line for line in r.out.splitlines()
             if "margin.s=inf" in line or "optim.lr=inf" in line]
    started = (work / "run").exists()
    return f"rc {r.rc}, {len(lines)} line(s) naming the keys, run folder made: {started}", \
        r.rc == 2 and len(lines) == 2 and not started


def _two_checkpoints(data: Path, work: Path) -> Result:
    return train(data, work / "run", "train.max_steps=4")


def planted_pickle(data: Path, work: Path) -> tuple[str, bool]:
    first = _two_checkpoints(data, work)
    marker = work / "pwned"
    (work / "run" / "checkpoints" / "step-00000004" / "state" / ".metadata").write_bytes(
        pickle.dumps(_Planted(str(marker))))
    r = train(data, first.run)
    fell_back = "resumed from" in r.out and "step-00000002" in r.out
    named = ".metadata: SHA-256 differs" in r.out
    ran = marker.exists()
    return f"rc {r.rc}, warning names .metadata: {named}, resumed from step 2: {fell_back}, " \
           f"payload ran: {ran}", r.rc == 0 and named and fell_back and not ran


class _Planted:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def bit_flip(data: Path, work: Path) -> tuple[str, bool]:
    first = _two_checkpoints(data, work)
    (part,) = (first.run / "checkpoints" / "step-00000004" / "state").glob("*.distcp")
    raw = bytearray(part.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 400] = bytes(b ^ 0x55 for b in raw[len(raw) // 2 :][:400])
    part.write_bytes(bytes(raw))
    r = train(data, first.run)
    named = f"{part.name}: SHA-256 differs" in r.out
    fell_back = "resumed from" in r.out and "step-00000002" in r.out
    return f"rc {r.rc}, warning names {part.name}: {named}, resumed from step 2: {fell_back}", \
        r.rc == 0 and named and fell_back


def kill_in_replace(data: Path, work: Path) -> tuple[str, bool]:
    first = _two_checkpoints(data, work)
    # A fresh run in the same folder re-saves step 2 over the old one and dies in between.
    killed = train(data, first.run, "checkpoint.resume=none", "train.max_steps=4",
                   inject=["kill-in-replace"])
    target = killed.latest()
    r = train(data, first.run, "train.max_steps=4")
    return f"killed rc {killed.rc}, latest -> {target}, restart rc {r.rc}, resumed: " \
           f"{'resumed from' in r.out}", killed.rc == -9 and r.rc == 0 and "resumed from" in r.out


def broken_latest(data: Path, work: Path) -> tuple[str, bool]:
    first = _two_checkpoints(data, work)
    root = first.run / "checkpoints"
    (root / "latest").write_text("step-00000099\n")
    meta = root / "step-00000004" / "meta.json"
    meta.write_text(meta.read_text()[:50])
    stale = root / ".tmp-step-00000006"
    stale.mkdir()
    r = train(data, first.run)
    warned = "does not name a usable checkpoint" in r.out and "meta.json: unreadable" in r.out
    resumed = "resumed from" in r.out and "step-00000002" in r.out
    return f"rc {r.rc}, warnings: {warned}, resumed from step 2: {resumed}, stale .tmp " \
           f"removed: {not stale.exists()}", r.rc == 0 and warned and resumed and not stale.exists()


def disk_full(data: Path, work: Path) -> tuple[str, bool]:
    r = train(data, work / "run", inject=["disk-full-at-2"])
    errors = r.errors()
    named = len(errors) == 1 and "(ENOSPC)" in errors[0]
    leftovers = sorted(p.name for p in (r.run / "checkpoints").iterdir())
    holds = r.rc == 1 and named and leftovers == ["latest", "step-00000002"]
    return f"rc {r.rc}, ENOSPC named in one line: {named}, left: {', '.join(leftovers)}", holds


def run_folder_fills_up(data: Path, work: Path) -> tuple[str, bool]:
    """A real full filesystem: the run folder on a 64 MiB tmpfs that another writer fills
    once the first checkpoint exists (needs root to mount; said so where refused)."""
    disk = work / "disk"
    disk.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        return "skipped: mount -t tmpfs refused (needs root)", True

    def fill_after_first_checkpoint(proc: subprocess.Popen) -> None:
        wait_for_step(disk / "run", 2, proc)
        wait_until(lambda: any((disk / "run" / "checkpoints").glob("step-*")), proc=proc,
                   every=0.05)
        with open(disk / "filler", "ab") as filler, contextlib.suppress(OSError):
            while True:
                filler.write(b"\0" * 2**20)
                filler.flush()

    try:
        r = train(data, disk / "run", "train.max_steps=400", "checkpoint.every=2",
                  until=fill_after_first_checkpoint)
        errors = r.errors()
        latest = r.latest()
        from trainer import checkpoint
        verifies = latest is not None and bool(checkpoint.verify(r.run / "checkpoints" / latest))
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    holds = r.rc == 1 and len(errors) == 1 and str(disk) in errors[0] and verifies
    return f"rc {r.rc}, one line naming the file: {len(errors) == 1}, latest {latest} " \
           f"verifies: {verifies}", holds


def sigterm_one_rank(data: Path, work: Path) -> tuple[str, bool]:
    """SIGTERM to rank 1 alone, in step 5 of 6 (the rank held there while the signal comes):
    both ranks save after step 5 and rank 0 says where to resume, once."""
    return _sigterm_in_step_5(data, work, lambda proc, pid: os.kill(pid, signal.SIGTERM))


def sigterm_whole_job(data: Path, work: Path) -> tuple[str, bool]:
    """SIGTERM to every process of the job (the launcher, both trainers, their loader
    workers), each by pid, as a scheduler does, in step 5 of 6: the trainers save after it,
    the launch exits 0 (``launch.torchrun``), and the resume equals an uninterrupted run."""
    return _sigterm_in_step_5(data, work, lambda proc, pid: signal_job(proc, signal.SIGTERM),
                              "data.num_workers=1")


def _sigterm_in_step_5(data: Path, work: Path, send: Callable[[subprocess.Popen, int], None],
                       *args: str) -> tuple[str, bool]:
    """A 2-rank run of :data:`STEPS` (6) steps whose rank 1 is held in step 5 while
    ``send(proc, rank 1's pid)`` signals; then its resume, against an uninterrupted run.

    The moment is the run's, not the machine's pace. These rows used to signal once step 2
    was logged, which on an idle machine could land in step 5: the stop then waited for the
    next step's agreement, step 6, the last, and the run simply finished (rc 0, no line).
    A signal now stops the run after the step it came in; step 5 is the last one where a
    stop leaves a step to resume."""
    whole = train(data, work / "whole", "checkpoint.every=0", *args, ranks=2)
    hold = work / "hold"
    split = train(data, work / "split", "checkpoint.every=0", *args, ranks=2,
                  inject=["hold-rank1-step5"], hold=hold,
                  until=lambda proc: while_held(hold, proc, lambda pid: send(proc, pid)))
    stopped = split.latest()
    told = split.out.count("stopped by SIGTERM after step 5: ") == 1 and "to resume" in split.out
    resumed = train(data, work / "split", "checkpoint.every=0", *args, ranks=2)
    same = _same_backbone(whole.run, resumed.run, STEPS)
    holds = split.rc == 0 and told and stopped == "step-00000005" and resumed.rc == 0 and same
    return f"launch rc {split.rc}, saved {stopped}, said where to resume once: {told}; " \
           f"resumed rc {resumed.rc}, final weights equal an uninterrupted run: {same}", holds


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)


def _end_once_reported(run: Path, pid: int, limit: float = 25) -> None:
    """Kill ``pid`` once rank 0's timeout report is in ``run/train.log`` (or after ``limit``
    seconds): the report is what the case checks, and waiting longer only waits."""
    log = run / "train.log"
    wait_until(lambda: log.is_file()
               and "timeout (dist.timeout_s=" in log.read_text(errors="replace"), limit)
    _kill_quietly(pid)


def _state(pid: int) -> str:
    """The one-letter state of ``pid`` (``T``: stopped), from /proc; ``?`` once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "?"


def stopped_rank(data: Path, work: Path, engine: str = "ddp",
                 in_backward: bool = False) -> tuple[str, bool]:
    """Rank 1 stopped (SIGSTOP from outside after step 2, or ``in_backward``: it stops itself
    in step 3's backward, leaving rank 0 in the data-parallel gradient reduction)."""
    stopped: list[tuple[int, float]] = []

    def stop_rank1(proc: subprocess.Popen) -> None:
        wait_for_step(work / "run", 2, proc)
        pids = worker_pids(proc)
        if 1 not in pids:
            return
        if not in_backward:
            os.kill(pids[1], 19)  # SIGSTOP: alive, silent, holding its peers in a collective
        wait_until(lambda: _state(pids[1]) == "T", 60, proc, every=0.05)
        stopped.append((pids[1], time.monotonic()))
        # Rank 0 reports after the 10 s timeout; then end the stopped rank rather than
        # wait out torchrun's 30 s SIGTERM grace (a stopped process defers SIGTERM).
        threading.Thread(target=_end_once_reported, args=(work / "run", pids[1]),
                         daemon=True).start()

    inject = ["stop-rank1-in-backward-3"] if in_backward else None
    r = train(data, work / "run", f"engine.type={engine}", "train.max_steps=50",
              "dist.timeout_s=10", ranks=2, until=stop_rank1, inject=inject)
    for pid, _ in stopped:
        _kill_quietly(pid)
    lines = [line for line in r.out.splitlines() if line.startswith("error on rank 0: step")]
    named = len(lines) == 1 and "a collective failed after 1" in lines[0] \
        and "timeout (dist.timeout_s=10)" in lines[0] and "resume from" in lines[0]
    if in_backward:
        named = named and lines[0].startswith("error on rank 0: step 3:") \
            and "step-00000002" in lines[0]
    return f"rc {r.rc}, {lines[0][:130] if lines else r.out[-300:]}", \
        bool(stopped) and r.rc != 0 and named


def _same_backbone(a: Path, b: Path, step: int) -> bool:
    import torch

    tag = f"step-{step:08d}"
    files = [p / "checkpoints" / tag / "backbone.pt" for p in (a, b)]
    if not all(f.is_file() for f in files):
        return False
    x, y = (torch.load(f, weights_only=True) for f in files)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x if "running" not in k)


def config_drift(data: Path, work: Path) -> tuple[str, bool]:
    first = _two_checkpoints(data, work)
    r = train(data, first.run, "margin.type=arcface", "margin.m=0.5")
    errors = r.errors()
    holds = r.rc == 2 and len(errors) == 1 and "margin.type 'cosface' -> 'arcface'" in errors[0]
    return f"rc {r.rc}, {len(errors)} line(s): {errors[0][:90] if errors else r.out[-200:]}", holds


def bad_label(data: Path, work: Path) -> tuple[str, bool]:
    bad = write_data(work / "data", labels={i: 25 for i in range(0, 160, 10)})
    r = train(bad, work / "run", "data.num_workers=1")
    errors = r.errors()
    named = len(errors) == 1 and "shard-" in errors[0] and "has label 25" in errors[0]
    return f"rc {r.rc}, {len(errors)} line(s): {errors[0][:100] if errors else '-'}", \
        r.rc == 1 and named and "Traceback" not in r.out


def corrupt_image_two_epochs(data: Path, work: Path) -> tuple[str, bool]:
    bad = write_data(work / "data", corrupt=(7,))
    r = train(bad, work / "run", "train.max_steps=null", "train.epochs=2")
    last = (r.records() or [{}])[-1]
    return f"rc {r.rc}, skipped_samples after 2 epochs: {last.get('skipped_samples')}", \
        r.rc == 0 and last.get("skipped_samples") == 1


def duplicate_yaml_key(data: Path, work: Path) -> tuple[str, bool]:
    recipe = work / "dup.yaml"
    recipe.write_text(f"base: {SMOKE}\nmargin:\n  s: 30.0\n  s: 64.0\n")
    cmd = [sys.executable, "-m", "launch.train", "--config", str(recipe), f"data.dir={data}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    named = "duplicate key 's' (first set at line 3)" in out.stderr
    return f"rc {out.returncode}, names the key and both lines: {named}", \
        out.returncode == 2 and named


def early_checks(data: Path, work: Path) -> tuple[str, bool]:
    blocker = work / "a-file"
    blocker.write_text("")
    r = train(data, blocker / "run", "train.batch_size=100000")
    lines = [line for line in r.out.splitlines() if "train.batch_size=100000" in line
             or "is not a folder" in line]
    return f"rc {r.rc}, {len(lines)} of 2 problems named before any process group", \
        r.rc == 2 and len(lines) == 2 and "Traceback" not in r.out


def batchnorm_copies_agree(data: Path, work: Path) -> tuple[str, bool]:
    r = train(data, work / "run", "train.max_steps=2", ranks=2)
    folder = r.run / "checkpoints" / "step-00000002"
    exported, stored = backbone_pt_and_dcp(folder)
    keys = [k for k in exported if "running" in k]
    worst = max(float((exported[k] - stored[k]).abs().max()) for k in keys) if keys else None
    return f"rc {r.rc}, {len(keys)} BatchNorm buffers, largest backbone.pt vs DCP " \
           f"difference {worst}", r.rc == 0 and bool(keys) and worst == 0.0


def backbone_pt_and_dcp(folder: Path) -> tuple[dict, dict]:
    import torch
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.integrity import SafeReader

    exported = torch.load(folder / "backbone.pt", weights_only=True)
    reader = SafeReader(folder / "state")
    metadata = reader.read_metadata().state_dict_metadata
    template = {f"backbone.{k}": torch.zeros(metadata[f"backbone.{k}"].size,
                                             dtype=metadata[f"backbone.{k}"].properties.dtype)
                for k in exported}
    dcp.load(template, storage_reader=reader, no_dist=True)
    return exported, {k[len("backbone."):]: v for k, v in template.items()}


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


