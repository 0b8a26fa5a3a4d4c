"""``make chaos`` row: an elastic job on two network namespaces (``make train NNODES=1:2``, one
rank per node, ``train.global_batch`` 16 of micro-batches of 8) loses its second node's
launcher mid-run, goes on alone with twice the accumulation, and takes the node back.

The job is started as a user starts it, through make on each node with nothing but
``NNODES=1:2`` and node 0's address: the rendezvous settings an elastic run needs
(``launch.rendezvous``) are the launcher's to make. The one setting given here,
``last_call_timeout=3`` (``PET_RDZV_CONF``), only shortens the wait of a group that shrinks
(30 s by default) so that the row takes about three minutes. Its expectations:

1. ``kill -9`` of node 1's launcher after step 5: its rank ends with it (an elastic launch),
   node 0's rank fails its next collective and its launcher restarts it alone;
2. the lone rank resumes from the last checkpoint with accumulation 2;
3. node 1 started again joins: node 0's launcher stops its rank (a checkpoint at the next
   step) and the group restarts on both nodes, accumulation 1, to the last step;

and over it all: every step's loss and lr equal an unbroken 1-process run's at the same
global batch (1e-5 relative), each micro-batch stream's loader position in the checkpoints both
runs keep is the unbroken run's (nothing lost or read twice), the metrics rows carry world
size and accumulation (2/1, 1/2, 2/1), one run folder, one W&B run (offline: one id over
every segment) and one ``launch.report`` page.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from itertools import groupby
from pathlib import Path

from tools.testbed.harness import (
    BASE_ARGS,
    Result,
    job_pids,
    signal_job,
    train,
    wait_for_step,
    wait_until,
)
from tools.testbed.nodes import PORT, Nodes, NoNamespaces, start_on_node, two_nodes

STEPS = 60  # long enough that the lone node is still training when node 1 is back
# 10 steps an epoch (160 images). lr 1e-5: the rounding of another summation order grows with
# the lr, on any two world sizes alike: an unbroken 2-rank run differs from the 1-process one
# by 3e-5 at step 6 at lr 1e-3; this row at 1e-4 passed 1e-5 after 20 steps (measured)
ARGS = ["train.global_batch=16", f"train.max_steps={STEPS}", f"train.epochs={STEPS // 10}",
        "optim.lr=0.00001", "checkpoint.every=4", "checkpoint.keep=100", "dist.timeout_s=60"]
RTOL = 1e-5


def start_node(nodes: Nodes, i: int, data: Path, run: Path, log: Path) -> subprocess.Popen:
    """``make train NNODES=1:2`` on node ``i`` (this venv's Python, no set-up step), its
    output in ``log``; W&B offline."""
    with open(log, "a") as out:  # the child keeps its own descriptor
        return start_on_node(nodes, i, [
            "make", "-s", "train", "SETUP=", f"PY={sys.executable}", "NNODES=1:2",
            f"MASTER_ADDR={nodes.master}", f"MASTER_PORT={PORT}", "SMOKE_NPROC=1",
            f"SMOKE_DATA={data}", "ARGS=" + " ".join([f"output={run}", *BASE_ARGS, *ARGS])],
            stdout=out, WANDB_MODE="offline", PET_RDZV_CONF="last_call_timeout=3")


def launcher(proc: subprocess.Popen) -> int | None:
    """The pid of the ``launch.torchrun`` that make started under ``proc``."""
    for pid in job_pids(proc.pid):
        try:
            if b"launch.torchrun" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


def stream_positions(folder: Path) -> dict[int, dict]:
    """Micro-batch stream ``j`` -> its loader position, over every rank of checkpoint
    ``folder`` (each stream's position is its own, whatever the world size)."""
    from trainer.checkpoint import read_meta

    return {s["stream"]: s["position"] for loader in read_meta(folder).loaders
            for s in loader["streams"]}


def elastic_case(data: Path, work: Path) -> tuple[str, bool]:
    run, started = work / "run", time.monotonic()
    unbroken = train(data, work / "unbroken", *ARGS)  # one process: accumulation 2
    procs: list[subprocess.Popen] = []
    try:
        with two_nodes() as nodes:
            procs += [start_node(nodes, i, data, run, work / f"node{i}.log") for i in (0, 1)]
            wait_for_step(run, 5, procs[0])
            killed = launcher(procs[1])
            if killed is not None:
                os.kill(killed, signal.SIGKILL)
            alone = wait_until(lambda: any(r.get("world_size") == 1
                                           for r in Result(0, "", run).records()), 240, procs[0])
            if alone:
                procs.append(start_node(nodes, 1, data, run, work / "node1-again.log"))
            codes = [_wait(p, 300) for p in procs]
    except NoNamespaces as err:
        return f"skipped: {err}", True
    finally:
        for proc in procs:  # whatever still runs (a case that failed half-way)
            if proc.poll() is None:
                signal_job(proc, signal.SIGKILL)
    return _judge(run, unbroken, killed, alone, codes, time.monotonic() - started)


def _wait(proc: subprocess.Popen, limit: float) -> int | None:
    try:
        return proc.wait(limit)
    except subprocess.TimeoutExpired:
        return None


def _judge(run: Path, unbroken: Result, killed: int | None, alone: bool,
           codes: list[int | None], took: float) -> tuple[str, bool]:
    """The row's observation and verdict from the run folder and the exit codes."""
    rows, reference = Result(0, "", run).records(), unbroken.records()
    losses = {r["step"]: (r["loss"], r["lr"]) for r in rows if "loss" in r}
    planned = {r["step"]: (r["loss"], r["lr"]) for r in reference if "loss" in r}
    worst = max((abs(a - b) / abs(b) for s in planned if s in losses
                 for a, b in zip(losses[s], planned[s], strict=True)), default=float("inf"))
    phases = [k for k, _ in groupby((r.get("world_size"), r.get("accumulation"))
                                    for r in rows if "loss" in r)]
    log = (run / "train.log").read_text() if (run / "train.log").is_file() else ""
    resumes = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", log)]
    kept = sorted({p.name for p in (run / "checkpoints").glob("step-*")}
                  & {p.name for p in (unbroken.run / "checkpoints").glob("step-*")})
    same_positions = bool(kept) and all(
        stream_positions(run / "checkpoints" / tag)
        == stream_positions(unbroken.run / "checkpoints" / tag) for tag in kept)
    wandb_id = (run / "wandb_run_id").read_text().strip() if (run / "wandb_run_id").is_file() \
        else None
    segments = sorted((run / "wandb").glob("offline-run-*"))
    one_wandb = wandb_id is not None and len(segments) >= 3 and all(
        p.name.endswith(f"-{wandb_id}") for p in segments)
    report = subprocess.run([sys.executable, "-m", "launch.report", str(run), "--out",
                             str(run / "report.html")], capture_output=True, text=True)
    reported = report.returncode == 0 and (run / "report.html").is_file()
    holds = (killed is not None and alone and codes[0] == 0 and codes[-1] == 0
             and phases == [(2, 1), (1, 2), (2, 1)] and len(resumes) == 2
             and sorted(losses) == sorted(planned) == list(range(1, STEPS + 1))
             and worst <= RTOL and same_positions and one_wandb and reported)
    return (f"phases (world size, accumulation) {phases}, resumed at steps {resumes}; "
            f"{len(losses)} steps, loss and lr vs unbroken worst rel {worst:.1e}; stream positions "
            f"equal at {len(kept)} checkpoints: {same_positions}; W&B id {wandb_id} over "
            f"{len(segments)} segments: {one_wandb}; report: {reported}; make rc {codes} "
            f"(node 1 killed, then again); {took:.0f} s"), holds
