"""All of the trainer's rank-0 I/O: console and RUN/train.log (:mod:`trainer.telemetry.console`),
RUN/config.yaml (and RUN/merge.txt with ``data.merge``), metrics.jsonl, histograms.jsonl
(:mod:`trainer.telemetry.run_files`), W&B and TensorBoard (:mod:`trainer.telemetry.sinks`).

Every rank constructs a :class:`RunLogger`; on ranks other than 0 every method is a no-op,
so call sites need no ``if rank == 0``. W&B runs offline by default (``log.wandb``); the
``WANDB_MODE`` environment variable, when set, wins (tests set ``disabled``). TensorBoard
with ``log.tensorboard=true``. Scale dynamics (s, theta_med, B_avg, mean target/non-target
cos) are logged every ``log.every`` steps, the only steps that read the loss and the
statistics from the device; target/non-target angle histograms every ``log.hist_every``. A
resumed run truncates both line files to the checkpoint's step, so no step appears twice,
and continues the same W&B run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from data_pipeline.door import read_bytes
from data_pipeline.merge import MAX_BYTES as MAX_MERGE_BYTES
from partial_fc.metric_names import MARGIN_STATS, OPTIONAL_STATS, SCALE_DYNAMICS
from trainer.config import Config, dump_config
from trainer.dist import launcher_rank
from trainer.errors import Stopped
from trainer.telemetry import run_files
from trainer.telemetry.console import Console
from trainer.telemetry.evaluation_log import flat_metrics
from trainer.telemetry.sinks import Sink, TensorBoardSink, WandbSink, scalars_of

if TYPE_CHECKING:
    from trainer.engine import StepResult


def print_main(message: str) -> None:
    """Print to stderr on rank 0 only; usable before any process group exists."""
    if launcher_rank() == 0:
        print(message, file=sys.stderr)


def memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, max RSS on CPU (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _json_safe(record: dict) -> dict:
    """``record`` with non-finite floats as null: ``NaN``/``Infinity`` are not JSON (a
    skipped step's loss is NaN; readers of metrics.jsonl must not choke on it)."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }


@dataclass(frozen=True)
class StepRecord:
    """The metrics of optimisation step ``step`` (1-based) that :meth:`RunLogger.step`
    writes on the steps that are due: ``head`` holds the head's scale dynamics
    (``partial_fc.metric_names.SCALE_DYNAMICS``) and the margin's own statistics present
    (``MARGIN_STATS``), ``data`` the loader's and the loop's
    counters summed over the ranks; :meth:`row` is its metrics.jsonl row."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    head: dict[str, float | None]
    img_per_s: float
    memory_mb: float
    data: dict[str, int | float]
    time_s: float
    epoch: int | None = None
    distill: dict[str, float] = field(default_factory=dict)  # the engine's distill_* numbers

    def row(self) -> dict:
        """The flat row: ``head``, ``distill`` and ``data`` entries at the top level,
        ``epoch`` last."""
        out = {"step": self.step, "loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm,
               **self.head, **self.distill, "img_per_s": self.img_per_s,
               "memory_mb": self.memory_mb, **self.data, "time_s": self.time_s}
        if self.epoch is not None:
            out["epoch"] = self.epoch
        return out


class WriteFailed(Stopped, RuntimeError):
    """A run file (metrics, histograms, train.log, TensorBoard) could not be written, e.g.
    ENOSPC: the run stops with the last good checkpoint as it is."""


class RunLogger:
    """Rank-0 sink for one run; ``global_batch`` = images per optimisation step, all ranks."""

    def __init__(self, cfg: Config, rank: int, total_steps: int, global_batch: int):
        self.active = rank == 0
        self.cfg, self.total, self.global_batch = cfg, total_steps, global_batch
        self.run_dir = cfg.run_dir
        self.history: list[StepRecord] = []
        self._metrics = self._hist = None
        self._sinks: list[Sink] = []
        self.write_error: str | None = None  # the first run file that could not be written
        self._t0 = self._last_t = time.perf_counter()
        self._last_step = self._start = 0
        if self.active:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.console = Console(self.run_dir, rank, cfg.log.progress)

    def info(self, message: str) -> None:
        """A message for the console and RUN/train.log (rank 0)."""
        self.console.info(message)

    def start(self, step: int) -> None:
        """Begin at optimisation step ``step`` (the checkpoint's when resumed): drop the rows
        after it from metrics.jsonl and histograms.jsonl, open both for appending, open the
        W&B run / TensorBoard writer, write RUN/config.yaml (and RUN/merge.txt, the list
        ``data.merge`` names, as trained), start timing."""
        self._t0 = self._last_t = time.perf_counter()
        self._last_step = self._start = step
        if not self.active:
            return
        (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))
        if self.cfg.data.merge is not None:  # what the run merged, beside its digest
            merged = read_bytes(self.cfg.data.merge, "the merge list", limit=MAX_MERGE_BYTES)
            (self.run_dir / run_files.MERGE_COPY).write_bytes(merged)
        for name in (run_files.METRICS, run_files.HISTOGRAMS):
            dropped = run_files.truncate_after(self.run_dir / name, step)
            if dropped:
                self.info(f"{name}: dropped {dropped} row(s) after step {step} (redone now)")
        cfg = self.cfg
        mode = os.environ.get("WANDB_MODE") or cfg.log.wandb
        if mode != "disabled":
            wandb = WandbSink(self.run_dir, mode, cfg.log.wandb_project, cfg.name,
                              cfg.model_dump(mode="json"))
            self._sinks.append(wandb)
            if wandb.backfilled:
                self.info(f"W&B: sent {wandb.backfilled} row(s) of {run_files.METRICS} that "
                          "an earlier segment's W&B record lacks")
        if cfg.log.tensorboard:
            self._sinks.append(TensorBoardSink(self.run_dir, dump_config(cfg), step))
        # Closed in close().
        self._metrics = open(self.run_dir / run_files.METRICS, "a")  # noqa: SIM115
        if self.cfg.log.hist_every:
            self._hist = open(self.run_dir / run_files.HISTOGRAMS, "a")  # noqa: SIM115
        self.console.start(step, self.total)

    def due(self, step: int) -> bool:
        """Whether step ``step`` writes a metrics record (every ``log.every`` and the last)."""
        return step % self.cfg.log.every == 0 or step == self.total

    def step(
        self,
        step: int,
        result: StepResult,
        head_stats: dict,
        data: dict | None,
        device: torch.device,
        epoch: int | None = None,
    ) -> None:
        """After optimisation step ``step`` (1-based count of steps done) of ``epoch``
        (0-based). ``data``: the loader's counters summed over ranks (``skipped_samples``,
        ``padded_samples``, with data at a URL ``storage_wait_share``, ``storage_retries``:
        ``trainer.run_state.data_counts``), given on the steps that are :meth:`due`.

        ``result`` (the engine's ``StepResult``) and ``head_stats`` are read only on the steps
        that are :meth:`due`: the engine and the head keep their numbers on the device
        (``partial_fc.readout.DeviceScalars``) and a read makes the host wait for the GPU."""
        if not self.active:
            return
        now = time.perf_counter()
        done, elapsed = step - self._start, max(now - self._t0, 1e-9)
        rate = self.global_batch * done / elapsed
        if not self.due(step):
            self.console.progress(step, rate)
            return
        img_s = self.global_batch * (step - self._last_step) / max(now - self._last_t, 1e-9)
        self._last_t, self._last_step = now, step
        entry = StepRecord(step=step, loss=result.loss, lr=result.lr,
                           grad_norm=result.grad_norm,
                           head={**{name: head_stats.get(name) for name in SCALE_DYNAMICS},
                                 **{name: head_stats[name]
                                    for name in (*OPTIONAL_STATS, *MARGIN_STATS)
                                    if name in head_stats}},
                           img_per_s=img_s, memory_mb=memory_mb(device), data=dict(data or {}),
                           time_s=now - self._t0, epoch=epoch,
                           distill={k: v for k, v in result.numbers.items()
                                    if k.startswith("distill_")})
        self.history.append(entry)
        record = entry.row()
        self.write(record)
        eta = (self.total - step) * elapsed / done if done else None
        self.console.metrics(record, self.total, epoch, eta)
        self.console.progress(step, rate)  # after the record: the bar shows its numbers

    def wants_histograms(self, step: int) -> bool:
        """Whether optimisation step ``step`` (1-based) samples angle histograms. From the
        config alone, so every rank agrees (the sample is a collective); never when
        ``log.hist_every=0``."""
        every = self.cfg.log.hist_every
        return every > 0 and step % every == 0

    def histograms(self, step: int, angles: dict[str, torch.Tensor]) -> None:
        """Angle distributions (degrees), e.g. ``{"theta_target": ..., "theta_nontarget": ...}``:
        counts per degree into histograms.jsonl, and to W&B / TensorBoard."""
        if not self.active:
            return
        values = {k: v.detach().float().cpu().numpy() for k, v in angles.items()}
        with self._guard(self._hist.name):
            self._hist.write(json.dumps(run_files.histogram_row(step, values)) + "\n")
            self._hist.flush()
        self._to_sinks(lambda sink: sink.histograms(step, values))

    def evaluation(self, step: int, results: dict[str, dict[str, float | int]]) -> None:
        """Verification results of ``trainer.evaluation.evaluate_bins`` (and RFW's groups
        and summary, ``evaluate_rfw_dir``)."""
        self.write({"step": step, **flat_metrics(results)})
        self.info("  ".join(f"{name}: acc {r['accuracy']:.4f}" if "accuracy" in r else
                            f"{name}: mean {r['mean']:.4f} gap {r['gap']:.4f}"
                            for name, r in results.items()))

    def write(self, record: dict) -> None:
        """One metrics.jsonl row (rank 0), and its numbers to the sinks."""
        if not self.active:
            return
        with self._guard(self._metrics.name):
            self._metrics.write(json.dumps(_json_safe(record)) + "\n")
            self._metrics.flush()
        scalars = scalars_of(record)
        self._to_sinks(lambda sink: sink.scalars(record["step"], scalars))

    @contextlib.contextmanager
    def _guard(self, path) -> Iterator[None]:
        """Keep the first OSError writing ``path`` for :meth:`write_failed`."""
        try:
            yield
        except OSError as err:
            if self.write_error is None:
                self.write_error = f"cannot write {path}: {err.strerror or err}"

    def _to_sinks(self, call: Callable[[Sink], None]) -> None:
        """``call`` on each sink. W&B is a copy of metrics.jsonl: a W&B failure drops it with
        one warning and the run goes on; TensorBoard's is a failed run file."""
        for sink in list(self._sinks):
            try:
                call(sink)
            except Exception as err:  # noqa: BLE001 - any W&B failure; the run goes on
                if not isinstance(sink, WandbSink):  # its OSError names the events file
                    with self._guard(getattr(err, "filename", None) or self.run_dir / "tb"):
                        raise
                    continue
                self._sinks.remove(sink)
                self.info(f"warning: W&B failed ({type(err).__name__}: {err}); "
                          f"logging to W&B stops, metrics.jsonl goes on")

    def write_failed(self) -> bool:
        """Whether a run file could not be written (rank 0; :attr:`write_error` says which):
        the loop then asks every rank to stop (``trainer.stopping.StopReason.DISK_FULL``)."""
        file = self.console.file
        if self.write_error is None and file is not None and file.error is not None:
            self.write_error = f"cannot write {file.baseFilename}: {file.error.strerror}"
        return self.write_error is not None

    def close_unused(self) -> None:
        """End a logger that never started (a finished run run again): only the console."""
        self.console.close()

    def close(self, step: int, checkpoint: Path | None) -> dict:
        """Finish the run and return its summary (rank 0; ``{}`` elsewhere): the bar closed
        first, then the sinks (W&B's own end-of-run lines come before ours, and only with
        ``log.wandb=online``), then one line on stdout with rounded figures and what to run
        next; the full summary goes to RUN/summary.json and train.log."""
        self.console.close_bar()
        if not self.active:
            self.console.close()
            return {}
        losses = [r.loss for r in self.history]
        elapsed = time.perf_counter() - self._t0
        summary = {
            "run": self.cfg.run_location,
            "steps": step,
            "steps_this_invocation": step - self._start,
            "time_s": round(elapsed, 1),
            "img_per_s": round(self.global_batch * (step - self._start) / max(elapsed, 1e-9), 1),
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "checkpoint": self.cfg.shown(checkpoint) if checkpoint else None,
        }
        self._metrics.close()
        if self._hist is not None:
            self._hist.close()
        self._to_sinks(lambda sink: sink.close(summary))
        if self.write_error:  # after the last checkpoint: it stays, the run reports
            raise WriteFailed(f"step {step}: {self.write_error}")
        text = json.dumps(_json_safe(summary))
        (self.run_dir / run_files.SUMMARY).write_text(text + "\n")
        self.console.log.info("summary: " + text, extra={"file_only": True})
        print(summary_line(summary, [s.next_step() for s in self._sinks]), flush=True)
        self.console.close()
        return summary


def summary_line(summary: dict, sink_steps: list[str]) -> str:
    """``summary: runs/smoke: 124 steps in 1:35 (124 img/s), loss 10.37 -> 0.054;
    checkpoint ...; report: python -m launch.report runs/smoke; ...`` on one line."""
    from datetime import timedelta

    def loss(value) -> str:
        return "nan" if value is None else f"{value:.4g}"

    run = summary["run"]
    parts = [f"summary: {run}: {summary['steps_this_invocation']} steps in "
             f"{timedelta(seconds=round(summary['time_s']))} ({summary['img_per_s']:.0f} img/s)"
             f", loss {loss(summary['loss_first'])} -> {loss(summary['loss_last'])}"]
    if summary["checkpoint"]:
        parts.append(f"checkpoint {summary['checkpoint']}")
    parts.append(f"report: python -m launch.report {run}")
    return "; ".join(parts + sink_steps)
