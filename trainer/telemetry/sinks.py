"""Optional metric sinks of rank 0: Weights & Biases and TensorBoard, same names in both.

Each is imported only when switched on (``log.wandb`` not ``disabled``, or
``log.tensorboard=true``), so a run without them never imports either package. Scalars are
the keys of a ``metrics.jsonl`` row (``loss``, ``scale``, ``val/lfw/accuracy``, ...);
histograms are ``theta_target`` / ``theta_nontarget`` in degrees, binned per degree like
``RUN/histograms.jsonl`` (:mod:`trainer.telemetry.run_files`).

W&B: one run per training across resumes. The run id is kept in ``RUN/wandb_run_id`` and
passed back with ``resume="allow"``; every chart's x axis is ``global_step`` (declared with
``define_metric``), so a resumed segment that logs steps again lines up instead of being
dropped by W&B's own monotonic step counter. A segment whose W&B service ended with the job
(a job-wide SIGTERM from SLURM, a lost node) leaves its last steps out of the W&B record
although metrics.jsonl has them; the next segment sends those first, in order, read back from
the earlier segments' own files (:mod:`trainer.telemetry.wandb_log`). Offline, W&B prints
nothing (its start and end-of-run lines would bury the trainer's; the history is in the run
folder and in metrics.jsonl); online it prints its usual lines, the run's URL among them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from trainer.telemetry import run_files, wandb_log

WANDB_ID_FILE = "wandb_run_id"
TENSORBOARD_DIR = "tb"


class Sink(Protocol):
    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def histograms(self, step: int, angles: dict[str, np.ndarray]) -> None: ...

    def close(self, summary: dict) -> None: ...

    def next_step(self) -> str:
        """What to run to look at this sink's record, for the run's summary line."""
        ...


def scalars_of(row: dict) -> dict[str, float]:
    """A metrics.jsonl row's numbers as the sinks take them: finite, without ``step``."""
    return {k: v for k, v in row.items()
            if k != "step" and isinstance(v, int | float) and math.isfinite(v)}


class WandbSink:
    """A W&B run (``mode``: offline | online) under ``RUN/wandb``; ``backfilled``: the
    metrics.jsonl rows it sent at its start that the earlier segments' records lacked."""

    def __init__(self, run_dir: Path, mode: str, project: str, name: str, config: dict):
        import wandb

        self._wandb, self._mode, self._dir = wandb, mode, run_dir / "wandb"
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        self.run = wandb.init(project=project, name=name, mode=mode, dir=str(run_dir),
                              config=config, id=run_id, resume="allow",
                              settings=wandb.Settings(silent=mode != "online"))
        id_file.write_text(self.run.id + "\n")
        self.run.define_metric("global_step")
        self.run.define_metric("*", step_metric="global_step")
        self.backfilled = self._backfill(run_dir / run_files.METRICS)

    def _backfill(self, metrics: Path) -> int:
        """Send the rows of ``metrics`` (truncated to the resumed step) whose numbers no
        earlier segment's record holds at their step, in order; how many (none without an
        earlier record to compare with). A job-wide SIGTERM ends the W&B service with the
        ranks, before it has written the last steps they sent, and a lost node's service
        ends without a signal: only the next segment can send those (docs/cluster.md)."""
        current = Path(getattr(self.run, "dir", "") or ".").parent
        earlier = [p for p in wandb_log.segments(self._dir, self.run.id) if p.parent != current]
        if not earlier:  # a first segment, or one whose records are gone: no gaps to fill
            return 0
        held: dict[int, set[str]] = {}
        for path in earlier:
            try:
                history = wandb_log.read(path).history
            except Exception:  # noqa: BLE001 - an unreadable record only costs its backfill
                continue
            for row in history:
                held.setdefault(row.get("global_step"), set()).update(row)
        missing = [row for row in run_files.read_jsonl(metrics) if "step" in row
                   and not set(scalars_of(row)) <= held.get(row["step"], set())]
        for row in missing:
            self.scalars(row["step"], scalars_of(row))
        return len(missing)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"global_step": step, **values})

    def histograms(self, step: int, angles: dict[str, np.ndarray]) -> None:
        edges = run_files.bin_edges()
        self.run.log({"global_step": step, **{
            name: self._wandb.Histogram(np_histogram=(run_files.angle_counts(v), edges))
            for name, v in angles.items()}})

    def close(self, summary: dict) -> None:
        self.run.summary.update(summary)
        self.run.finish()

    def next_step(self) -> str:
        if self._mode == "online":
            return f"W&B: {self.run.url}"
        return f"W&B: wandb sync {self._dir}/offline-run-*"


class TensorBoardSink:
    """Event files under ``RUN/tb`` (``tensorboard --logdir RUN/tb``). Resumed at ``step``,
    it hides the older files' events after that step (``purge_step``): they are redone.

    A run file like metrics.jsonl, not a copy like W&B: a write that fails (ENOSPC, EIO)
    stops the run at the next step boundary with one line naming the file (a run
    whose dashboard silently ends mid-way misleads more than one that stops). TensorBoard
    writes from its own thread (``EventFileWriter``'s ``_AsyncWriterThread``), which keeps
    the error and re-raises it at the next ``add_*``/``flush`` of the training thread; every
    call here flushes, so that is the same step. That thread's own traceback (Python's
    ``threading.excepthook``) is silenced for the writer's threads only, and every error is
    raised as an ``OSError`` naming the events file, which ``RunLogger`` turns into the stop.
    """

    def __init__(self, run_dir: Path, config_yaml: str, step: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # trainer.config checks first; this is the last word
            raise ImportError(f"log.tensorboard=true needs the tensorboard package ({err}); "
                              f"pip install 'partial-fc[tensorboard]'") from None
        self._dir = run_dir / TENSORBOARD_DIR
        before = set(threading.enumerate())
        self.writer = SummaryWriter(log_dir=str(self._dir),
                                    purge_step=step + 1 if step else None)
        self._threads = set(threading.enumerate()) - before  # the event writer's
        self._excepthook = threading.excepthook
        threading.excepthook = self._quiet_writer_thread
        with self._named():
            self.writer.add_text("config", "```\n" + config_yaml + "```")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        with self._named():
            for key, value in values.items():
                self.writer.add_scalar(key, value, global_step=step)
            self.writer.flush()

    def histograms(self, step: int, angles: dict[str, np.ndarray]) -> None:
        with self._named():
            for name, values in angles.items():
                self.writer.add_histogram(name, values, global_step=step,
                                          bins=run_files.bin_edges())
            self.writer.flush()

    def close(self, summary: dict) -> None:
        try:
            with self._named():
                self.writer.add_text("summary", "```\n" + json.dumps(summary, indent=1) + "\n```")
                self.writer.close()
        finally:
            if threading.excepthook == self._quiet_writer_thread:
                threading.excepthook = self._excepthook

    def _quiet_writer_thread(self, args) -> None:
        """``threading.excepthook``: the writer thread's error is raised at the next call."""
        if args.thread not in self._threads:
            self._excepthook(args)

    @contextlib.contextmanager
    def _named(self) -> Iterator[None]:
        """Any failure of the writer (this thread's or re-raised from its own) as an
        ``OSError`` naming the newest events file."""
        try:
            yield
        except Exception as err:  # noqa: BLE001 - the writer's, from either thread
            files = sorted(self._dir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
            path = files[-1] if files else self._dir
            code = getattr(err, "errno", None) or errno.EIO
            raise OSError(code, getattr(err, "strerror", None) or str(err), str(path)) from err

    def next_step(self) -> str:
        return f"TensorBoard: tensorboard --logdir {self._dir}"
