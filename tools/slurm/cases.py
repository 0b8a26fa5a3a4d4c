"""``make chaos`` rows on a real two-node SLURM cluster (:mod:`tools.slurm.cluster`):
scripts/slurm/train.sbatch submitted as docs/cluster.md submits it, with the smoke config on
CPU ranks (the script's GPU lines replaced by ``--gpus-per-node=0 --cpus-per-task=1``: one
rank a node), ``train.global_batch=16`` of micro-batches of 8, and the scheduler doing each
case's damage: a time limit, ``scontrol requeue``, a preempting job, a lost node, ``scancel``,
a second job on the same run folder, a bad config or data folder.

Each row checks the job's states as ``sacct --completion`` records them and, where the run
trained, every step's loss and lr against an unbroken 1-process run of the same recipe (1e-5
relative, as the elastic row: lr 1e-5, see tools/chaos/elastic.py), one run folder and one
W&B run id. The submitting environment is the user's: the venv's ``python`` first on PATH
(sbatch exports it to the job), W&B offline, one thread a rank. A requeued job waits about
two minutes before it may start again (SLURM's own delay, ``Reason=BeginTime``), which the
requeue rows wait out: they take 3-5 minutes each.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tools.slurm.cluster import GRACE_S, NAMES, Cluster, ClusterDidNotStart, NoSlurm, cluster
from tools.testbed.harness import ROOT, SMOKE, Result, train, wait_until
from trainer.telemetry import wandb_log

SCRIPT = "scripts/slurm/train.sbatch"
CPU = ("--gpus-per-node=0", "--cpus-per-task=1")  # the script's GPU node, as a CPU one
SITE = ("--gpus-per-node=1", "--cpus-per-task=2")  # one fake GPU, so one rank, and 2 CPUs
STEPS = 24  # 10 steps an epoch (160 images, global batch 16)
ARGS = ("engine.type=ddp", "train.batch_size=8", "data.num_workers=0", "log.every=1",
        "log.progress=false", "checkpoint.every=2", "checkpoint.keep=100",
        "train.global_batch=16", "optim.lr=0.00001", "dist.timeout_s=60")
# the self-requeue row: at --time=3 --signal=B:USR1@60 the notice comes 60-120 s into each
# run (60 s before the limit, on SLURM's 30 s tick, "up to 60 s earlier" says sbatch(1)),
# after a start-up of 25 s idle, over 60 s with other SLURM rows beside (a notice before the
# trainers start requeues the job at once): a run trains 95 s at most, 43 steps of 2.2 s, so
# 90 steps need three runs or more (measured: 5 runs of 35-40 steps at 160 steps of 1.2 s).
SEGMENTED_STEPS, SEGMENTED_PACE_S = 90, "2.0"
RTOL = 1e-5
REQUEUED_S = 330  # a requeued job: KillWait, SLURM's ~120 s delay, start-up, the run
HOOKS = ROOT / "tools" / "slurm" / "job_hooks"  # sitecustomize: pacing, affinity, exit codes
ERRORS = ("error", "config error", "launch error")  # how a one-line refusal starts
_UNBROKEN: dict[tuple[Path, int], Result] = {}


def recipe(steps: int = STEPS) -> tuple[str, ...]:
    return (*ARGS, f"train.max_steps={steps}", f"train.epochs={steps // 10 + 1}")


def unbroken(data: Path, work: Path, steps: int = STEPS) -> Result:
    """The recipe in one process, never interrupted (once per data set, length and process)."""
    if (data, steps) not in _UNBROKEN:
        _UNBROKEN[data, steps] = train(data, work / f"unbroken-{steps}", *recipe(steps))
    return _UNBROKEN[data, steps]


def submit(c: Cluster, data: Path, run: Path, *options: str, args: tuple[str, ...] = (),
           steps: int = STEPS, script: str = SCRIPT, **env: str) -> int:
    """``sbatch [options] scripts/slurm/train.sbatch configs/smoke.yaml ...`` as a user with
    the venv active submits it, one rank a node (:data:`SITE` on the site-like cluster, else
    :data:`CPU`); output to ``RUN/../%j.out``. The job id."""
    shape = SITE if c.site else CPU
    run.parent.mkdir(parents=True, exist_ok=True)
    return c.sbatch(*shape, f"--output={run.parent}/%j.out", *options, script, str(SMOKE),
                    f"data.dir={data}", f"output={run}", *recipe(steps), *args,
                    PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                    WANDB_MODE="offline", OMP_NUM_THREADS="1", **env)


def out(run: Path, job: int) -> str:
    path = run.parent / f"{job}.out"
    return path.read_text() if path.is_file() else ""


def last_step(run: Path) -> int:
    rows = Result(0, "", run).records()
    return max((r.get("step", 0) for r in rows), default=0)


def at_step(c: Cluster, job: int, run: Path, step: int, limit: float = 240) -> bool:
    """Wait until the job has trained ``step`` steps (False: it ended or ``limit`` passed)."""
    return wait_until(lambda: last_step(run) >= step or c.state(job) not in
                      ("PENDING", "CONFIGURING", "RUNNING", ""), limit) and last_step(run) >= step


def ended(c: Cluster, job: int, limit: float) -> str:
    """Wait for the job's end; its final state (scontrol)."""
    return c.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                              "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"), limit)


def same_run(run: Path, reference: Result, steps: int = STEPS) -> tuple[str, bool]:
    """Every step's loss and lr against the unbroken run's, and the W&B record whole
    (:func:`wandb_whole`)."""
    rows = {r["step"]: (r["loss"], r["lr"]) for r in Result(0, "", run).records() if "loss" in r}
    planned = {r["step"]: (r["loss"], r["lr"]) for r in reference.records() if "loss" in r}
    worst = max((abs(a - b) / abs(b) for s in planned if s in rows
                 for a, b in zip(rows[s], planned[s], strict=True)), default=float("inf"))
    record, whole = wandb_whole(run)
    holds = sorted(rows) == sorted(planned) == list(range(1, steps + 1)) and worst <= RTOL
    return f"{len(rows)} steps, worst rel {worst:.1e} vs unbroken; {record}", holds and whole


def wandb_whole(run: Path) -> tuple[str, bool]:
    """The run's W&B record read back from its segments' ``.wandb`` files: one run id over
    them, each segment's steps ascending, and every step metrics.jsonl holds there with its
    loss (a step's last value over the segments: a resumed segment redoes the steps after the
    checkpoint). Also how many rows the segments sent that an earlier one lacked."""
    losses = {r["step"]: r["loss"] for r in Result(0, "", run).records() if "loss" in r}
    id_file = run / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else None
    paths = wandb_log.segments(run / "wandb", run_id) if run_id else []
    held, ids, ordered, torn = {}, set(), True, 0
    for path in paths:
        log = wandb_log.read(path)
        ids |= log.run_ids
        torn += log.torn
        steps = [h["global_step"] for h in log.history if "loss" in h]
        ordered = ordered and steps == sorted(set(steps))
        held |= {h["global_step"]: h["loss"] for h in log.history if "loss" in h}
    log_text = (run / "train.log").read_text() if (run / "train.log").is_file() else ""
    sent = [int(n) for n in re.findall(r"W&B: sent (\d+) row", log_text)]
    whole = bool(paths) and ids == {run_id} and ordered and held == losses
    missing = sorted(set(losses) - set(held))
    return (f"W&B {run_id}: {len(paths)} segment(s) ({torn} torn), {len(held)} steps, "
            f"backfilled {sent}, whole {whole}" + (f", missing {missing[:8]}" if missing
                                                   else "")), whole


def resumes(run: Path) -> list[int]:
    log = (run / "train.log").read_text() if (run / "train.log").is_file() else ""
    return [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", log)]


def stopped_at(run: Path) -> int | None:
    """The step a stop signal saved at (train.log's ``stopped by SIG... after step N``)."""
    log = (run / "train.log").read_text() if (run / "train.log").is_file() else ""
    found = re.findall(r"stopped by SIG\w+ after step (\d+)", log)
    return int(found[-1]) if found else None


def on_cluster(check: Callable[[Cluster, Path, Path], tuple[str, bool]], site: bool = True
               ) -> Callable[[Path, Path], tuple[str, bool]]:
    """A row's ``(data, work)`` check run on a fresh cluster (``site``: the site-like one,
    tools/slurm/cluster.py); a skip where SLURM cannot run, a failure where it can but the
    cluster did not start.
    The cluster's folder is under /tmp, not ``work``: slurmd's socket paths must stay under
    108 bytes. It is removed when the row holds, else named in the observation."""
    def row(data: Path, work: Path) -> tuple[str, bool]:
        folder = Path(tempfile.mkdtemp(prefix="pfc-slurm-"))
        try:
            with cluster(folder, keep=True, site=site) as c:
                started = time.monotonic()
                observed, holds = check(c, data, work)
        except NoSlurm as err:
            shutil.rmtree(folder, ignore_errors=True)
            return f"skipped: {err}", True
        except ClusterDidNotStart as err:
            return f"the cluster did not start: {err}; its logs: {folder}", False
        if holds:
            shutil.rmtree(folder, ignore_errors=True)
            return f"{observed}; {time.monotonic() - started:.0f} s", holds
        said = [f"{p.name}: {ln}" for p in sorted(work.glob("*.out"))
                for ln in p.read_text().splitlines() if ln.startswith((*ERRORS, "srun: error"))]
        return (f"{observed}; {time.monotonic() - started:.0f} s; the cluster's logs: {folder}; "
                f"the jobs said: {' | '.join(said) or '-'}"), holds
    return row


# ----------------------------------------------------------------------------- the cases


def two_nodes_complete(c: Cluster, data: Path, work: Path) -> tuple[str, bool]:
    reference, run = unbroken(data, work), work / "run"
    job = submit(c, data, run)
    state = ended(c, job, 300)
    same, matches = same_run(run, reference)
    world = {r.get("world_size") for r in Result(0, "", run).records() if "loss" in r}
    folders = [p for p in run.parent.iterdir() if p.is_dir()
               and not p.name.startswith("unbroken")]
    states = c.sacct(job)
    return (f"{state}, sacct {states}, world sizes {sorted(world)}, folders "
            f"{[p.name for p in folders]}; {same}"), \
        state == "COMPLETED" and states == ["COMPLETED|0:0"] and world == {2} and matches \
        and len(folders) == 1


def self_requeue(c: Cluster, data: Path, work: Path) -> tuple[str, bool]:
    """``--time=3 --signal=B:USR1@60`` on a run of 90 steps paced at 2 s a micro-batch
    (about 200 s of training; a run trains 95 s at most between its start-up and the
    notice, 60-120 s into the job): at each notice the ranks save at the next step and the
    script requeues the job; it ends COMPLETED after three segments or more with the unbroken
    run's losses, no one resubmitting anything. SLURM's two-minute hold on a requeued job is
    lifted (:func:`run_out`): not what this row tests."""
    reference, run = unbroken(data, work, SEGMENTED_STEPS), work / "run"
    job = submit(c, data, run, "--time=3", "--signal=B:USR1@60", steps=SEGMENTED_STEPS,
                 args=("checkpoint.every=10",), PYTHONPATH=str(HOOKS),
                 PFC_PACE_S=SEGMENTED_PACE_S, MAX_REQUEUES="8")
    state, lifted = run_out(c, job, 1500)
    text, states = out(run, job), c.sacct(job)
    notices = text.count("time-limit notice")
    requeued = text.count("time limit: requeueing job")
    stops = [int(n) for n in re.findall(r"stopped by SIGUSR1 after step (\d+)",
                                        (run / "train.log").read_text())]
    same, matches = same_run(run, reference, SEGMENTED_STEPS)
    return (f"{state} after {len(states)} run(s) ({lifted} hold(s) lifted), {notices} notice(s),"
            f" {requeued} requeue(s) by the script, saved at {stops}, resumed at "
            f"{resumes(run)}; sacct {states}; {same}"), \
        state == "COMPLETED" and len(states) >= 3 and states[-1] == "COMPLETED|0:0" \
        and requeued == len(states) - 1 and stops == [s for s in resumes(run) if s] \
        and matches


def run_out(c: Cluster, job: int, limit: float) -> tuple[str, int]:
    """Wait for the job's end through its requeues, starting it at once each time SLURM
    holds it (22.05: about two minutes, ``Reason=BeginTime``); its final state and how many
    holds were lifted."""
    deadline, lifted = time.monotonic() + limit, 0
    while time.monotonic() < deadline:
        state = ended(c, job, 5)
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", ""):
            return state, lifted
        if state == "PENDING" and "Reason=BeginTime" in c.run(
                "scontrol", "-o", "show", "job", str(job), check=False):
            c.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
            lifted += 1
    return c.state(job), lifted


def requeue(c: Cluster, data: Path, work: Path) -> tuple[str, bool]:
    reference, run = unbroken(data, work), work / "run"
    job = submit(c, data, run)
    reached = at_step(c, job, run, 6)
    c.run("scontrol", "requeue", str(job))
    requeued = time.monotonic()
    pending = c.wait_state(job, ("PENDING",), 60)
    restarted = c.wait_state(job, ("RUNNING",), REQUEUED_S)
    waited = time.monotonic() - requeued
    state = ended(c, job, REQUEUED_S)
    saved, same_, matches = stopped_at(run), *same_run(run, reference)
    states = c.sacct(job)
    return (f"requeued at step >= 6: {reached}, saved at {saved}, {pending} then {restarted} "
            f"after {waited:.0f} s, {state}, resumed at {resumes(run)}; sacct {states}; "
            f"{same_}"), reached and saved is not None and pending == "PENDING" \
        and state == "COMPLETED" and resumes(run) == [saved] and matches \
        and states[-1] == "COMPLETED|0:0" and len(states) == 2


def preemption(c: Cluster, data: Path, work: Path) -> tuple[str, bool]:
    """A 2-node job in partition ``urgent`` (PriorityTier 10) preempts the run in ``batch``:
    SIGTERM to every task at once, the ranks save at the next step, and the script requeues
    the job (docs/cluster.md) although every rank of that run exits 3 (tools/slurm/job_hooks:
    a trainer failing while preempted); it resumes once the urgent job is done (SLURM's hold
    lifted, :func:`run_out`)."""
    reference, run = unbroken(data, work), work / "run"
    job = submit(c, data, run, PYTHONPATH=str(HOOKS), PFC_FAIL_FIRST_RUN="1")
    reached = at_step(c, job, run, 6)
    urgent = c.sbatch("--partition=urgent", "--nodes=2", f"--output={work}/%j.out",
                      "--wrap", "sleep 5")
    preempted = time.monotonic()
    pending = c.wait_state(job, ("PENDING",), GRACE_S + 30)
    freed = time.monotonic() - preempted
    saved = stopped_at(run)
    state, _ = run_out(c, job, REQUEUED_S)
    same, matches = same_run(run, reference)
    states, urgent_states = c.sacct(job), c.sacct(urgent)
    said = "preempted: requeueing job" in out(run, job)
    return (f"preempted at step >= 6: {reached}, saved at {saved}, requeued by the script: "
            f"{said}, nodes freed after {freed:.0f} s (GraceTime {GRACE_S}), {state}, resumed "
            f"at {resumes(run)}; sacct {states}, urgent {urgent_states}; {same}"), \
        reached and saved is not None and said and pending == "PENDING" and freed < GRACE_S \
        and state == "COMPLETED" and resumes(run) == [saved] and matches \
        and urgent_states == ["COMPLETED|0:0"] and states[-1] == "COMPLETED|0:0"


def lost_node(c: Cluster, data: Path, work: Path) -> tuple[str, bool]:
    """``--nodes=1-2`` on both nodes; node 1 lost at step 6 (its link cut, every process on
    it killed): SLURM marks it DOWN, requeues the job (NODE_FAIL), which restarts on node 0
    alone at accumulation 2 (SLURM's hold lifted, :func:`run_out`) and matches the unbroken
    run."""
    reference, run = unbroken(data, work), work / "run"
    job = submit(c, data, run, "--nodes=1-2")
    reached = at_step(c, job, run, 6)
    c.lose_node(1)
    lost = time.monotonic()
    down = wait_until(lambda: "down" in c.run("sinfo", "-h", "-n", NAMES[1], "-o", "%t"), 60)
    detected = time.monotonic() - lost
    state, _ = run_out(c, job, REQUEUED_S + 60)
    rows = [r for r in Result(0, "", run).records() if "loss" in r]
    phases = sorted({(r.get("world_size"), r.get("accumulation")) for r in rows})
    same, matches = same_run(run, reference)
    states = c.sacct(job)
    return (f"lost at step >= 6: {reached}, DOWN after {detected:.0f} s: {down}, {state}, "
            f"(world size, accumulation) {phases}, resumed at {resumes(run)}; sacct {states}; "
            f"{same}"), reached and down and state == "COMPLETED" \
        and phases == [(1, 2), (2, 1)] and len(resumes(run)) == 1 and matches \
        and states == ["NODE_FAIL|0:0", "COMPLETED|0:0"]


def cancel(c: Cluster, data: Path, work: Path) -> tuple[str, bool]:
    """``scancel JOB``: SIGTERM to every process of the job (batch script, srun, launchers,
    ranks), SIGKILL KillWait later: the ranks save at the next step and the job is CANCELLED;
    the same sbatch again resumes there."""
    reference, run = unbroken(data, work), work / "run"
    job = submit(c, data, run)
    reached = at_step(c, job, run, 6)
    c.run("scancel", str(job))
    sent = time.monotonic()
    state = ended(c, job, 90)
    took = time.monotonic() - sent
    saved = stopped_at(run)
    again = submit(c, data, run)
    state2 = ended(c, again, 300)
    same, matches = same_run(run, reference)
    states = (c.sacct(job), c.sacct(again))
    return (f"cancelled at step >= 6: {reached}, {state} after {took:.0f} s, saved at {saved}; "
            f"again {state2}, resumed at {resumes(run)}; sacct {states}; {same}"), \
        reached and state == "CANCELLED" and saved is not None and state2 == "COMPLETED" \
        and resumes(run) == [saved] and matches \
        and states == (["CANCELLED|0:0"], ["COMPLETED|0:0"])


def second_submission(c: Cluster, data: Path, work: Path) -> tuple[str, bool]:
    """One job per node on one run folder: the second is refused in one line of its output
    (the script's check, before any rank), FAILED with exit code 2; the first finishes."""
    reference, run = unbroken(data, work), work / "run"
    first = submit(c, data, run, "--nodes=1", f"--nodelist={NAMES[0]}")
    reached = at_step(c, first, run, 3)
    second = submit(c, data, run, "--nodes=1", f"--nodelist={NAMES[1]}")
    state2 = ended(c, second, 120)
    state = ended(c, first, 300)
    lines = [ln for ln in out(run, second).splitlines() if ln.startswith(ERRORS)]
    refused = len(lines) == 1 and "is in use by another job" in lines[0]
    same, matches = same_run(run, reference)
    states = (c.sacct(first), c.sacct(second))
    return (f"second {state2}: {lines[0][:100] if lines else '-'}; first {state}; sacct "
            f"{states}; {same}"), reached and refused and state2 == "FAILED" \
        and state == "COMPLETED" and matches and states == (["COMPLETED|0:0"], ["FAILED|2:0"])


def input_errors(c: Cluster, data: Path, work: Path) -> tuple[str, bool]:
    """A bad config key and a data folder without a manifest: each printed once in the
    job's output, the job FAILED (exit code 2) within seconds, no rank started."""
    found = []
    for name, args in (("config", ("margin.typo=1",)), ("data", ())):
        run = work / name
        folder = data if name == "config" else work / "empty"
        folder.mkdir(exist_ok=True)
        job = submit(c, folder, run, args=args)
        started = time.monotonic()
        state = ended(c, job, 120)
        took = time.monotonic() - started
        text = out(run, job)
        lines = [ln for ln in text.splitlines() if ln.startswith(ERRORS)]
        found.append((name, state, c.sacct(job), len(lines), took, "rank(s) on" in text))
    return "; ".join(f"{n}: {s} {a} in {t:.0f} s, {k} error line(s), ranks started {r}"
                     for n, s, a, k, t, r in found), \
        all(s == "FAILED" and a == ["FAILED|2:0"] and k == 1 and t < 60 and not r
            for _, s, a, k, t, r in found)
