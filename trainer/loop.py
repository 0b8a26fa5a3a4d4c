"""The training run, top to bottom: :func:`train` builds the run (``trainer.build``), resumes
it, runs :func:`loop` (each :func:`one_step`, then checkpoints, evaluation and the agreed stop)
and finishes it. A run's counters and the counts it reports are in ``trainer.run_state``; how a
failure is told (a failed collective naming the phase, the one report) in ``trainer.failures``.

``launch.train`` is the program around it; it validates the config before calling
:func:`train` inside the process group. The run folder layout is in ``launch/train.py``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import torch

from trainer import checkpoint
from trainer.build import build
from trainer.config import Config, resume_drift
from trainer.dist import DistEnv
from trainer.errors import Stopped
from trainer.failures import collectives_of
from trainer.overrules import margin_words, schedule_jump
from trainer.preemption import StopSignals
from trainer.run_state import Run, data_counts
from trainer.run_store import store_of
from trainer.stopping import StopReason, StopRequest, StopRequested, StopRequests
from trainer.telemetry.logger import WriteFailed


def _groups(batches, k: int) -> Iterator[list]:
    """Consecutive groups of ``k`` loader batches (one optimisation step each)."""
    it = iter(batches)
    while group := list(itertools.islice(it, k)):
        if len(group) == k:
            yield group


class Diverged(Stopped, RuntimeError):
    """``train.max_bad_steps`` steps in a row had a non-finite loss or gradient (all ranks)."""


def train(cfg: Config, env: DistEnv, stops: StopRequests | None = None) -> dict:
    """Run (or resume) training on every rank; returns rank 0's summary (``{}`` elsewhere).
    ``stops``: the run's stop requests, when a watcher (the run lock) was handed them
    before the run was built.
    A collective that fails in any phase (a peer stopped, died or was cut off) ends this
    rank with one :class:`CollectiveFailed` line naming the phase."""
    timeout = cfg.dist.timeout_s
    with collectives_of(lambda: "building the engine", timeout):
        run = build(cfg, env, stops)
    with collectives_of(lambda: "resuming", timeout):
        resume(run)
    if run.step >= run.total:
        return already_finished(run)
    saved = lambda: run.saved  # noqa: E731 - read when the report is made
    # The signals are recorded until the run's end: one that comes after the last step's
    # agreement must not kill a rank in the last save (trainer.preemption).
    with StopSignals(lambda: (run.step, run.step_started), run.stops, run.total):
        with collectives_of(lambda: f"step {run.step + 1}", timeout, saved,
                             since=lambda: run.step_started):
            stopped_by = loop(run)
        with collectives_of(lambda: f"after step {run.step}", timeout, saved):
            return finish(run, stopped_by)


def resume(run: Run) -> None:
    """Restore the newest verified checkpoint (``checkpoint.resume``) or seed a fresh run."""
    cfg, env, loader = run.cfg, run.env, run.loader
    path = checkpoint.find_resume(cfg.run_dir, cfg.checkpoint.resume, env, store_of(cfg))
    if env.is_main:
        checkpoint.remove_stale(cfg.run_dir)
    if path is None:
        torch.manual_seed(cfg.seed + 1 + env.rank)  # per-rank stream (dropout), from the seed
    else:
        saved = checkpoint.read_meta(path).config
        changed = resume_drift(saved, cfg, str(path))
        if changed:
            run.log.info(f"resuming with changed settings: {', '.join(changed)}")
        meta = checkpoint.load(path, run.engine)
        jump = schedule_jump(saved, cfg, meta.step, run.steps_per_epoch, changed)
        if jump and meta.step < run.total:
            run.log.info(jump)
        run.step, run.saved = meta.step, path
        run.bad_steps = meta.bad_steps
        run.skipped_steps = meta.skipped_steps
        run.skipped_samples = meta.skipped_samples
        loader.load_saved(meta.loaders, env.rank)
        finished = len(loader) - loader.batches_done < run.accum
        run.epoch = loader.epoch + 1 if finished else loader.epoch
        if run.step >= run.total:
            return  # already_finished says so
        run.log.info(f"resumed from {cfg.shown(path)} at step {run.step} "
                     f"(saved on {meta.world_size} ranks)")
    run.log.info(
        f"{cfg.name} ({cfg.run_location}): {margin_words(cfg)}; "
        f"{env.world_size} rank(s) on {env.device.type}"
        + (f" x {run.accum} micro-batch(es) of {cfg.train.batch_size} per step "
           f"(train.global_batch={cfg.train.global_batch})" if cfg.train.global_batch else "")
        + f", {run.total} steps, "
        f"{run.steps_per_epoch} steps/epoch, C={cfg.data.num_classes}, "
        f"engine={cfg.engine.type}, dropped {loader.dropped_fraction:.2%} of each epoch"
        + (f", excluded {loader.num_excluded} samples (data.exclude)" if loader.num_excluded
           else "")
        + (f", {loader.num_unindexed} shard(s) without a member index, read more slowly "
           "(python -m launch.convert index DIR adds them)" if loader.num_unindexed else "")
    )


def already_finished(run: Run) -> dict:
    """A rerun of a finished run: one line saying so and how to go on; no W&B run is opened
    and nothing is written. Returns ``{}`` (nothing was trained)."""
    cfg = run.cfg
    if run.total == cfg.train.epochs * run.steps_per_epoch:
        further = f"train.epochs={2 * cfg.train.epochs}"
    else:
        further = f"train.max_steps={2 * run.total}"
    run.log.info(f"{cfg.run_location} already finished at step {run.step}; `{further}` to train "
                 f"further, `checkpoint.resume=none` to start over")
    run.log.close_unused()
    return {}


def loop(run: Run) -> str | None:
    """Train until ``run.total`` steps; returns what stopped it early (a signal's name, the
    launcher's death), None when it ran to the end."""
    cfg = run.cfg
    run.log.start(run.step)
    while run.step < run.total:
        run.loader.set_epoch(run.epoch)  # the same epoch again keeps a resumed position
        for passes in run.engine.prefetch(_groups(run.loader, run.accum)):
            watched_stops(run)
            stop = one_step(run, passes)
            if stop.reason and not stop.reason.saves:  # no checkpoint: the last one stays
                raise stop_error(run, stop)
            if run.step >= run.total:
                return None
            if cfg.checkpoint.every and run.step % cfg.checkpoint.every == 0:
                save(run)
            if evaluates(cfg) and run.step % cfg.eval.every == 0:
                evaluate(run)
            if stop:  # agreed in the step: every rank stops after this same step
                return stopped_by(run, stop)
        run.epoch += 1
    return None


def watched_stops(run: Run) -> None:
    """Before each step, into ``run.stops``: a run file rank 0 could not write. The signals,
    the launcher's death and the lock's loss need no visit: their watchers ask ``run.stops``
    themselves, and the step reads it at its agreement."""
    if run.log.write_failed():
        run.stops.request(StopReason.DISK_FULL, run.log.write_error)


def stop_error(run: Run, stop: StopRequest) -> Exception:
    """The one line a stop without a checkpoint ends the run with, the same on every rank
    but for the detail only the asking rank knows."""
    resume = "run the same command again to resume from the last checkpoint"
    if stop.reason is StopReason.DISK_FULL:
        what = run.log.write_error or "rank 0 could not write a run file"
        return WriteFailed(f"step {run.step}: {what}; free space and {resume}")
    what = run.stops.detail or f"a rank stopped the run ({stop.reason.name.lower()})"
    if stop.reason is StopReason.LOCK_LOST:  # the folder is another job's now
        return StopRequested(f"step {run.step}: {what}")
    return StopRequested(f"step {run.step}: {what}; {resume}")


def stopped_by(run: Run, stop: StopRequest) -> str:
    """What stopped a run that saves: the signal's name, or the launcher's death as the
    rank that saw it says it."""
    if stop.reason is StopReason.LAUNCHER_GONE and run.stops.reason is stop.reason:
        return run.stops.detail
    return stop.signal_name


def one_step(run: Run, micro_batches: list) -> StopRequest:
    """One optimisation step, its metrics, and the non-finite-step bookkeeping. The step's
    loss and statistics stay on the device (the engine's one host read is its verdict) and
    are read by ``log.step`` on the steps that write a metrics record. Returns the stop
    request agreed over the ranks (this rank's: ``run.stops``, read at the agreement)."""
    cfg, log = run.cfg, run.log
    run.step_started = time.monotonic()
    hist = log.wants_histograms(run.step + 1)
    if cfg.distill.embeddings is None:
        result = run.engine.step(run.step, micro_batches, angles=hist, stops=run.stops)
    else:  # offline distillation: the batches' keys become the teacher's stored embeddings
        batches, teachers = zip(*map(run.engine.distillation.split, micro_batches), strict=True)
        result = run.engine.step(run.step, list(batches), angles=hist, stops=run.stops,
                                 teachers=teachers)
    for note in result.notes:  # the head's choices, once each
        log.info(note)
    run.step += 1
    if result.overflow:  # fp16 loss scale too high: skipped, not diverging
        run.skipped_steps += 1
    elif result.skipped:  # the same on every rank, so all raise together below
        run.bad_steps += 1
        run.bad_in_a_row += 1
    else:
        run.bad_in_a_row = 0
    counts = data_counts(run) if log.due(run.step) else None
    log.step(run.step, result, result.head_stats, counts, run.env.device, epoch=run.epoch)
    if hist:
        log.histograms(run.step, result.angles)
    if not result.skipped or result.overflow:
        return result.stop
    log.info(f"step {run.step}: non-finite loss or gradient (loss {result.loss:.4g}, "
             f"grad norm {result.grad_norm:.4g}); skipped on every rank")
    if run.bad_in_a_row >= cfg.train.max_bad_steps:
        raise Diverged(
            f"step {run.step}: {run.bad_in_a_row} steps in a row had a non-finite loss or "
            f"gradient (train.max_bad_steps={cfg.train.max_bad_steps}); the run diverges: "
            f"lower optim.lr or margin.s, or resume from {run.saved or 'the start'} with "
            f"other settings"
        )
    return result.stop


def save(run: Run) -> None:
    """Checkpoint step ``run.step`` (collective)."""
    cfg = run.cfg
    record = checkpoint.RunRecord(
        loader=run.loader.state_dict(), name=cfg.name, config=cfg.model_dump(mode="json"),
        bad_steps=run.bad_steps, skipped_steps=run.skipped_steps,
        skipped_samples=run.skipped_samples)
    run.saved = checkpoint.save(cfg.run_dir, run.step, run.engine, record, cfg.checkpoint.keep,
                                store_of(cfg))


def evaluates(cfg) -> bool:
    """Whether the run evaluates: ``eval.bins`` or ``eval.rfw`` set."""
    return bool(cfg.eval.bins) or cfg.eval.rfw is not None


def evaluate(run: Run) -> None:
    """Verification accuracy on ``eval.bins`` and RFW's groups on ``eval.rfw`` (every rank
    embeds its share)."""
    from trainer.evaluation import evaluate_bins, evaluate_rfw_dir

    cfg, backbone = run.cfg.eval, run.engine.backbone
    with run.engine.eval_context():
        results = evaluate_bins(backbone, cfg.bins, cfg.batch_size, run.env.device,
                                process_group=run.env.group)
        if cfg.rfw is not None:
            results |= evaluate_rfw_dir(backbone, cfg.rfw, cfg.batch_size, run.env.device,
                                        process_group=run.env.group)
    run.log.evaluation(run.step, results)


def finish(run: Run, stopped_by: str | None) -> dict:
    """The last checkpoint (unless this step's exists), the last evaluation, the summary.
    Stopped by a signal: the checkpoint only, and where to resume."""
    if run.saved is None or run.saved.name != checkpoint.tag_for(run.step):
        save(run)
    if stopped_by is not None:
        run.log.info(f"stopped by {stopped_by} after step {run.step}: checkpoint "
                     f"{run.cfg.shown(run.saved)}; run the same command again to resume "
                     "(checkpoint.resume=auto)")
    elif evaluates(run.cfg):
        evaluate(run)
    return run.log.close(run.step, run.saved)
