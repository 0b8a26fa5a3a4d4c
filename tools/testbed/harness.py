"""The fault-injection harness behind ``python -m tools.chaos`` (``make chaos``).

Each case runs ``launch.train`` (the smoke config, iresnet_tiny, a small synthetic set; 1
process or 2 ranks under torchrun), breaks something the way it breaks in production — a
diverging learning rate, a NaN on one rank, a planted pickle, a flipped bit, a kill inside
a checkpoint replacement, a signal to one rank, a full disk, bad data, a bad config — and
checks what the run did. One table comes out (case | expected | observed | holds); the exit
code is 0 only when every row holds. The cases are in ``tools/chaos/cases.py``;
``tests/e2e/test_faults.py`` runs the same ones.

Faults that need a hand inside the process (a NaN on one rank at one step, a kill at one
line of the checkpoint code, a disk that fills up, a rank stopping in its backward, a rank
held at a known point while the harness signals it: :func:`while_held`) go
through ``python -m tools.chaos inject FAULT -- <train arguments>``, which attaches a hook
to one of the seams the trainer declares (``trainer/seams.py``) and then runs
``launch.train.main``. The faults used to replace attributes of production code
(``PartialFC.forward``, ``layout.shutil.rmtree``, ``torch.save``); a rename then broke a
case silently or with an AttributeError deep in a run. A seam is declared once, with what
it passes, ``seams.attach`` refuses an undeclared name, and
``tests/trainer/test_seams.py`` checks that every fault here attaches to declared seams
and that the training code fires each of them. Nothing here assigns to a production
module or to torch.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from trainer import seams

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.yaml"
STEPS = 6
BASE_ARGS = ["engine.type=ddp", "train.batch_size=8", "data.num_workers=0", "log.every=1",
             "log.progress=false", f"train.max_steps={STEPS}", "checkpoint.every=2",
             "checkpoint.keep=5"]


@dataclass(frozen=True)
class Case:
    name: str
    expected: str
    check: Callable[[Path, Path], tuple[str, bool]]  # (data, workdir) -> (observed, holds)


# ----------------------------------------------------------------------------- data


def write_data(folder: Path, corrupt: tuple[int, ...] = (), labels: dict[int, int] | None = None,
               num_classes: int = 20, per_class: int = 8) -> Path:
    """A synthetic set (``num_classes`` x ``per_class`` images), then sample ``i`` of the
    shards' order made undecodable for ``i`` in ``corrupt`` and relabelled per ``labels``."""
    from data_pipeline import write_synthetic_dataset
    from data_pipeline.manifest import read_manifest, write_manifest
    from data_pipeline.tar_reader import tar_samples
    from data_pipeline.writer import Sample, write_shard

    write_synthetic_dataset(folder, num_classes=num_classes, images_per_class=per_class, seed=0)
    if not corrupt and not labels:
        return folder
    manifest = read_manifest(folder)
    infos, index = [], 0
    for info in manifest.shards:
        samples = []
        for raw in tar_samples(folder / info.name):
            jpg, label = raw["jpg"], int(raw["cls"])
            if index in corrupt:
                jpg = jpg[:3] + b"garbage" * 20
            label = (labels or {}).get(index, label)
            samples.append(Sample(raw["__key__"], jpg, label, raw.get("src", b"").decode()))
            index += 1
        infos.append(write_shard(folder / info.name, samples))
    write_manifest(folder, replace(manifest, shards=tuple(infos)))
    return folder


# ----------------------------------------------------------------------------- running


@dataclass
class Result:
    rc: int
    out: str  # stdout and stderr together
    run: Path

    def records(self) -> list[dict]:
        path = self.run / "metrics.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    def latest(self) -> str | None:
        path = self.run / "checkpoints" / "latest"
        return path.read_text().strip() if path.is_file() else None

    def errors(self) -> list[str]:
        starts = ("error", "config error")
        return [line for line in self.out.splitlines() if line.startswith(starts)]


def train(data: Path, run: Path, *args: str, ranks: int = 1, inject: list[str] | None = None,
          timeout: float = 240, until: Callable[[subprocess.Popen], None] | None = None,
          hold: Path | None = None) -> Result:
    """``launch.train`` on the smoke config with :data:`BASE_ARGS` and ``args``: in one
    process, or ``ranks`` under the launcher; ``inject`` = ``[FAULT, ...]`` attached first.
    ``until(proc)`` runs while the training runs (e.g. to send a signal); ``hold``: the
    folder where a ``hold-*`` fault and :func:`while_held` meet."""
    module = ["-m", "tools.chaos", "inject", *inject, "--"] if inject else ["-m", "launch.train"]
    if ranks > 1:  # the README's launcher: torchrun that leaves SIGTERM/SIGUSR1 to the ranks
        cmd = [sys.executable, "-m", "launch.torchrun", "--standalone",  # a free port
               "--nproc_per_node", str(ranks), *module]
    else:
        cmd = [sys.executable, *module]
    cmd += ["--config", str(SMOKE), f"data.dir={data}", f"output={run}", *BASE_ARGS, *args]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    if hold is not None:
        hold.mkdir(parents=True, exist_ok=True)
        os.mkfifo(hold / GO)
        env[HOLD_ENV] = str(hold)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    if until is not None:
        until(proc)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        out += f"\n(chaos: killed after {timeout} s)"
    return Result(proc.returncode, out, run)


def worker_pids(torchrun: subprocess.Popen) -> dict[int, int]:
    """``{rank: pid}`` of torchrun's training processes (read from /proc)."""
    found = {}
    for child in Path(f"/proc/{torchrun.pid}/task").glob("*/children"):
        for pid in child.read_text().split():
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            ranks = [e[5:] for e in environ if e.startswith(b"RANK=")]
            if ranks:
                found[int(ranks[0])] = int(pid)
    return found


def job_pids(pid: int) -> list[int]:
    """``pid`` and every process under it (launcher, ranks, loader workers): what a scheduler
    signals, each by its pid (``scancel --signal``), read from /proc."""
    pids = [pid]
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in children.read_text().split():
            pids += job_pids(int(child))
    return pids


def running(pid: int) -> bool:
    """Whether process ``pid`` runs: not gone, and not a zombie that no reaper collects (the
    orphans of a killed launcher, where PID 1 of a container does not reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def signal_job(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to every process of the job ``proc`` started, as a scheduler does."""
    for pid in job_pids(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


HOLD_ENV = "CHAOS_HOLD"  # the folder where a held rank and the harness meet
HELD, GO = "held", "go"  # a file: the held rank's pid; a FIFO: the harness lets it go on


def while_held(hold: Path, proc: subprocess.Popen, action: Callable[[int], None]) -> None:
    """Wait until a ``hold-*`` fault holds its rank (or the run ends), run ``action(pid)``
    with the held rank's pid (e.g. signal it), then let the rank go on. Whatever ``action``
    does has happened before the held rank runs another line of the step: a signal's handler
    runs as the rank wakes, so the step's agreement, later in the same step, sees it, at
    any pace of the machine."""
    wait_until(lambda: (hold / HELD).is_file(), proc=proc, every=0.05)
    if proc.poll() is not None:  # ended: nobody is held, nobody would read GO
        return
    action(int((hold / HELD).read_text()))
    with open(hold / GO, "w") as go:  # opens once the rank waits on the other end
        go.write("go")


def wait_until(done: Callable[[], bool], limit: float = float("inf"),
               proc: subprocess.Popen | None = None, every: float = 0.2) -> bool:
    """Poll ``done()`` every ``every`` s until it holds (True), or ``limit`` s pass or ``proc``
    ends first (False)."""
    deadline = time.monotonic() + limit
    while not done():
        if time.monotonic() >= deadline or (proc is not None and proc.poll() is not None):
            return False
        time.sleep(every)
    return True


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, limit: float = 180) -> None:
    """Block until metrics.jsonl records ``step`` (or the process ends, or ``limit`` s)."""
    path = run / "metrics.jsonl"
    wait_until(lambda: path.is_file() and any(json.loads(line).get("step", 0) >= step
                                              for line in path.read_text().splitlines()),
               limit, proc)


# ----------------------------------------------------------------------------- injection


def _nan_once(on_rank: int, call: int) -> None:
    """The head's loss of the ``call``-th training micro-batch (1-based) on ``on_rank`` becomes
    NaN, once (seam ``head-loss``: the step's backward, its finite check and the log see it)."""
    calls = [0]

    def poison(loss, rank: int):
        if rank == on_rank:
            calls[0] += 1
            if calls[0] == call:
                return loss * float("nan")
        return None

    seams.attach("head-loss", poison)


def _kill_in_replace() -> None:
    """SIGKILL this process right after a checkpoint replacement removed the old folder
    (seam ``checkpoint-replaced``, rank 0)."""
    seams.attach("checkpoint-replaced", lambda final: os.kill(os.getpid(), 9))


def _disk_full(at: int) -> None:
    """From the ``at``-th checkpoint on, every part a rank writes fails with a real
    ``OSError(ENOSPC)`` raised where the bytes would go (seam ``checkpoint-write``)."""
    steps: list[int] = []

    def no_space(path, step: int, rank: int):
        if step not in steps:
            steps.append(step)
        if len(steps) >= at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    seams.attach("checkpoint-write", no_space)


def _stop_in_backward(on_rank: int, call: int) -> None:
    """``on_rank`` sends itself SIGSTOP in its ``call``-th backward pass (1-based), when the
    backbone's first weight gets its gradient: its peers are then waiting in the
    data-parallel gradient reduction (DDP's buckets, ZeRO's all-reduce on DeepSpeed's own
    group). A real signal; the seam (``backbone-built``) only picks the moment."""
    calls = [0]

    def stop_in_backward(backbone, rank: int):
        if rank != on_rank:
            return

        def hook(grad):
            calls[0] += 1
            if calls[0] == call:
                os.kill(os.getpid(), signal.SIGSTOP)
            return grad

        next(backbone.parameters()).register_hook(hook)

    seams.attach("backbone-built", stop_in_backward)


def _wait_for_harness() -> None:
    """Tell :func:`while_held` this process's pid, and block until it says go (reading its
    FIFO: a signal meanwhile runs its handler and the read goes on, PEP 475)."""
    hold = Path(os.environ[HOLD_ENV])
    (hold / ".held").write_text(str(os.getpid()))
    (hold / ".held").rename(hold / HELD)  # whole, or not there
    with open(hold / GO) as go:
        go.read()


def _hold_in_step(on_rank: int, call: int) -> None:
    """``on_rank`` waits for the harness in its ``call``-th training micro-batch (1-based),
    after the head's forward and before its backward and the step's agreement (seam
    ``head-loss``); its peers wait for it in the step's collectives."""
    calls = [0]

    def hold(loss, rank: int):
        if rank == on_rank:
            calls[0] += 1
            if calls[0] == call:
                _wait_for_harness()

    seams.attach("head-loss", hold)


def _hold_in_save(on_rank: int, at_step: int) -> None:
    """``on_rank`` waits for the harness before it writes the first part of the checkpoint of
    step ``at_step`` (seam ``checkpoint-write``): after the loop, for the run's last step."""
    held = []

    def hold(path, step: int, rank: int):
        if rank == on_rank and step == at_step and not held:
            held.append(path)
            _wait_for_harness()

    seams.attach("checkpoint-write", hold)


FAULTS = {
    "hold-rank0-step5": lambda: _hold_in_step(on_rank=0, call=5),
    "hold-rank1-step5": lambda: _hold_in_step(on_rank=1, call=5),
    "hold-rank1-last-save": lambda: _hold_in_save(on_rank=1, at_step=STEPS),
    "stop-rank1-in-backward-3": lambda: _stop_in_backward(on_rank=1, call=3),
    "nan-rank1-step3": lambda: _nan_once(on_rank=1, call=3),
    "kill-in-replace": _kill_in_replace,
    "disk-full-at-2": lambda: _disk_full(at=2),
}


def table(rows: list[tuple[str, str, str, bool]]) -> str:
    """Markdown: case | expected | observed | holds."""
    lines = ["| case | expected | observed | holds |", "| --- | --- | --- | --- |"]
    lines += [f"| {c} | {e} | {o} | {'yes' if h else 'NO'} |" for c, e, o, h in rows]
    return "\n".join(lines)
