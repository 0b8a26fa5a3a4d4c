"""The training run: build (config -> engine, loader, logger), resume, the step loop with
checkpoints, evaluation and stop signals, and the one report of a failure.

``launch.train`` is the program around it; it validates the config before calling
:func:`train` inside the process group. The run folder layout is in ``launch/train.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer import checkpoint, seams
from trainer.config import (
    Config,
    ConfigError,
    resume_drift,
)
from trainer.config.accumulation import accumulation, images_per_step, micro_batches
from trainer.dist import DistEnv
from trainer.errors import (
    Scope,
    Stopped,
    classify,
    collective_detail,
    is_collective_failure,
    yield_to_reporter,
)
from trainer.overrules import epochs_end_first, margin_words, run_length, schedule_jump
from trainer.preemption import StopSignals
from trainer.run_store import store_of
from trainer.stopping import StopReason, StopRequest, StopRequested, StopRequests
from trainer.telemetry.console import append_log
from trainer.telemetry.logger import RunLogger, WriteFailed

if TYPE_CHECKING:
    from data_pipeline.epoch_batches import EpochBatches
    from trainer.engine import Engine


def _groups(batches, k: int) -> Iterator[list]:
    """Consecutive groups of ``k`` loader batches (one optimisation step each)."""
    it = iter(batches)
    while group := list(itertools.islice(it, k)):
        if len(group) == k:
            yield group


class Diverged(Stopped, RuntimeError):
    """``train.max_bad_steps`` steps in a row had a non-finite loss or gradient (all ranks)."""


class CollectiveFailed(Stopped, RuntimeError):
    """A collective timed out or lost a peer: another rank stopped, died or fell behind.
    Each rank that waited reports it (the others may be stopped or gone)."""

    scope = Scope.ONE_RANK


@contextlib.contextmanager
def _collectives_of(phase: Callable[[], str], timeout_s: float,
                    resume_from: Callable[[], Path | None] = lambda: None,
                    since: Callable[[], float] | None = None) -> Iterator[None]:
    """Turn a failed collective inside the block into the one-line :class:`CollectiveFailed`
    (any other error passes through): ``phase()`` names where the run was ("step 12",
    "building the engine", ...), ``resume_from()`` the checkpoint a rerun resumes, and the
    wait is counted from ``since()`` (the block's start when None; a step's own start in
    the loop)."""
    started = time.monotonic()
    try:
        yield
    except RuntimeError as err:  # torch's DistError subclasses and gloo's plain RuntimeError
        if not is_collective_failure(err):
            raise
        waited = time.monotonic() - (started if since is None else since())
        raise CollectiveFailed(
            f"{phase()}: a collective failed after {waited:.0f} s ({collective_detail(err)}): "
            "another rank stopped, died or fell behind by more than the process group's "
            f"timeout (dist.timeout_s={timeout_s:g}); resume from {resume_from() or 'the start'}"
        ) from None


@dataclass
class Run:
    """One run on one rank: what :func:`build` makes and the counters the loop advances."""

    cfg: Config
    env: DistEnv
    engine: Engine
    loader: EpochBatches
    log: RunLogger
    total: int  # optimisation steps of the whole run
    steps_per_epoch: int
    accum: int = 1  # micro-batches per rank per step (trainer.config.accumulation)
    step: int = 0  # steps done
    epoch: int = 0
    saved: Path | None = None  # the newest checkpoint this process wrote or resumed from
    bad_steps: int = 0  # skipped as non-finite, in all
    skipped_steps: int = 0  # dropped by DeepSpeed's fp16 loss scaler (overflow), in all
    skipped_samples: int = 0  # corrupt samples: the most any epoch met (all ranks)
    bad_in_a_row: int = 0
    step_started: float = 0.0  # time.monotonic() when the current step began
    storage_seen: tuple[int, int, int] = (0, 0, 0)  # storage retries, wait ms, stream ms
    stops: StopRequests = field(default_factory=StopRequests)  # this rank's, read at each step


def train(cfg: Config, env: DistEnv, stops: StopRequests | None = None) -> dict:
    """Run (or resume) training on every rank; returns rank 0's summary (``{}`` elsewhere).
    ``stops``: the run's stop requests, when a watcher (the run lock) was handed them
    before the run was built.
    A collective that fails in any phase (a peer stopped, died or was cut off) ends this
    rank with one :class:`CollectiveFailed` line naming the phase."""
    timeout = cfg.dist.timeout_s
    with _collectives_of(lambda: "building the engine", timeout):
        run = build(cfg, env, stops)
    with _collectives_of(lambda: "resuming", timeout):
        resume(run)
    if run.step >= run.total:
        return already_finished(run)
    saved = lambda: run.saved  # noqa: E731 - read when the report is made
    # The signals are recorded until the run's end: one that comes after the last step's
    # agreement must not kill a rank in the last save (trainer.preemption).
    with StopSignals(lambda: (run.step, run.step_started), run.stops, run.total):
        with _collectives_of(lambda: f"step {run.step + 1}", timeout, saved,
                             since=lambda: run.step_started):
            stopped_by = loop(run)
        with _collectives_of(lambda: f"after step {run.step}", timeout, saved):
            return finish(run, stopped_by)


def build(cfg: Config, env: DistEnv, stops: StopRequests | None = None) -> Run:
    """Backbone, head, loader, engine and logger, identically seeded on every rank; ``stops``
    the run's stop requests (a fresh holder when no watcher was handed one)."""
    from partial_fc import PartialFC, build_margin
    from partial_fc.aux_losses import AuxLosses
    from partial_fc.backbones import build_backbone
    from trainer.distill import Distillation
    from trainer.engine import Engine

    torch.manual_seed(cfg.seed)  # identical backbone init on every rank
    backbone = build_backbone(**cfg.backbone.build_kwargs())
    if cfg.backbone.weights is not None:
        from trainer.checkpoint.backbone import load_initial_weights

        load_initial_weights(backbone, cfg.backbone.weights)
    seams.BACKBONE_BUILT(backbone, rank=env.rank)
    head = PartialFC(cfg.backbone.embedding_size, cfg.data.num_classes,
                     build_margin(cfg.margin_kwargs()), process_group=env.group, seed=cfg.seed,
                     device=env.device, aux_losses=AuxLosses(**cfg.loss.model_dump()),
                     **cfg.partial_fc_kwargs())
    k = accumulation(cfg.train, env.world_size)
    loader = build_loader(cfg, env)
    if loader.num_classes != cfg.data.num_classes:  # the head trusts the loader's labels
        raise ConfigError(f"data.num_classes={cfg.data.num_classes}: the data has "
                          f"{loader.num_classes} classes (manifest.json); set data.num_classes="
                          f"{loader.num_classes} or drop the key (the manifest fills it)")
    steps_per_epoch = len(loader) // k
    if steps_per_epoch == 0:
        raise ConfigError(f"train.grad_accum={k}: more than the {len(loader)} batches per epoch")
    total, warmup = run_length(cfg, steps_per_epoch)
    distillation = Distillation.from_config(cfg, env.device)
    if cfg.distill.head_init:  # before the engine: a resumed run loads its rows over these
        distillation.init_head(head, cfg.data.dir)
    engine = Engine(cfg, backbone, head, env, total_steps=total, warmup_steps=warmup,
                    distillation=distillation)
    log = RunLogger(cfg, env.rank, total, images_per_step(cfg.train, env.world_size))
    overruled = epochs_end_first(cfg, steps_per_epoch)
    if overruled:
        log.info(overruled)
    if warmup >= total:  # known only here: the steps per epoch depend on the loader
        log.info(f"warning: the lr warm-up (schedule.warmup_epochs={cfg.schedule.warmup_epochs:g}"
                 f", {warmup} steps) outlasts the run ({total} steps), so the lr never decays; "
                 f"lower schedule.warmup_epochs or raise train.max_steps")
    return Run(cfg, env, engine, loader, log, total, steps_per_epoch, k,
               stops=stops if stops is not None else StopRequests())


def build_loader(cfg: Config, env: DistEnv) -> EpochBatches:
    """This rank's batches: the shard loader on ``data.dir`` (or mixing ``data.dirs``), or
    (``data.source=synthetic``) batches generated on the rank's device; seeded by ``seed``.
    The shard loaders' flip is deferred to the engine, which mirrors on the run's device
    (``flip="deferred"``: the same images, one image in two less for a decoding worker).
    With ``train.global_batch``, this rank's micro-batch streams, each the source rank ``j``
    of ``n`` would have (data_pipeline.micro_batches: placed by global position)."""
    from data_pipeline.micro_batches import MicroBatchStreams

    n = micro_batches(cfg.train)
    if n is None:
        return _batch_source(cfg, env.rank, env.world_size, env.device)
    return MicroBatchStreams(lambda j: _batch_source(cfg, j, n, env.device), rank=env.rank,
                             world_size=env.world_size, streams=n)


def _batch_source(cfg: Config, rank: int, world_size: int,
                  device: torch.device) -> EpochBatches:
    """The batch source of ``rank`` of ``world_size`` (see :func:`build_loader`)."""
    from data_pipeline import SyntheticStream, make_loader
    from data_pipeline.remote_shards import Streaming

    common = {"batch_size": cfg.train.batch_size, "rank": rank,
              "world_size": world_size, "seed": cfg.seed, "flip": cfg.data.flip}
    if cfg.data.source == "synthetic":
        return SyntheticStream(cfg.data.num_classes, cfg.data.synthetic_images_per_class,
                               device=device, **common)
    common.update(num_workers=cfg.data.num_workers, pin_memory=device.type == "cuda",
                  flip="deferred" if cfg.data.flip else False, max_pixels=cfg.data.max_pixels,
                  streaming=Streaming(cache_dir=cfg.data.cache_dir, cache_gib=cfg.data.cache_gib))
    if cfg.data.dirs is not None:
        from data_pipeline.merge import read_merge
        from data_pipeline.mixture import make_mixed_loader

        merge = None if cfg.data.merge is None else read_merge(cfg.data.merge)
        if merge is not None and merge.digest != cfg.data.merge_digest:  # edited since --check
            raise ConfigError(f"data.merge={cfg.data.merge}: its pairs changed after the "
                              f"config was checked (digest {merge.digest}, checked "
                              f"{cfg.data.merge_digest}); start the run again")
        return make_mixed_loader(cfg.data.dirs, weights=cfg.data.weights,
                                 excludes=cfg.data.exclusions(), merge=merge, **common)
    return make_loader(cfg.data.dir, exclude=cfg.data.exclusions()[0],
                       with_keys=cfg.distill.embeddings is not None, **common)


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


def data_counts(run: Run) -> dict[str, int | float]:
    """Collective: corrupt samples and samples repeated to pad (all ranks), and the steps
    skipped as non-finite (``bad_steps``) or by the fp16 loss scaler (``skipped_steps``).
    Every epoch meets the same corrupt files, so ``skipped_samples`` is the most any one
    epoch has counted, not a sum that grows by them each epoch.

    Reading a folder at a URL, also the share of the time the loader's workers (all ranks)
    waited on storage since the last record (``storage_wait_share``,
    data_pipeline.epoch_batches.StorageWait) and the reads retried since this process
    started (``storage_retries``); in the same gather, so no host sync is added."""
    from partial_fc.distributed import gather_ints

    loader, storage = run.loader, run.loader.storage
    counts = gather_ints([loader.num_skipped, loader.num_padded, storage.retries,
                          round(1000 * storage.wait_s), round(1000 * storage.stream_s)],
                         run.env.device, run.env.group).sum(0).tolist()
    run.skipped_samples = max(run.skipped_samples, counts[0])
    out = {"skipped_samples": run.skipped_samples, "padded_samples": counts[1],
           "bad_steps": run.bad_steps, "skipped_steps": run.skipped_steps,
           "world_size": run.env.world_size, "accumulation": run.accum}
    if loader.reads_url:
        (_, waited, streamed), now = run.storage_seen, tuple(counts[2:])
        out["storage_wait_share"] = (now[1] - waited) / max(now[2] - streamed, 1)
        out["storage_retries"] = now[0]
        run.storage_seen = now
    return out


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


def report_failure(err: Exception, rank: int, run_dir: Path | None) -> int:
    """Print a failure after the process group started, and append it to ``run_dir``'s
    train.log (every rank that reports; None: the folder is not this job's); returns the
    exit code.

    Which ranks print, what and the exit code are the error's to say
    (:func:`trainer.errors.classify`): one line from rank 0 for an error every rank raises
    together (config, checkpoint, divergence), one line from the rank that met it for its
    data or a failed collective, and for anything else (a bug) the traceback from each rank.
    """
    report = classify(err, rank)
    if report.prints:
        print(report.text, end="" if report.text.endswith("\n") else "\n", file=sys.stderr,
              flush=True)
        if run_dir is not None:
            append_log(run_dir, report.logged)
    else:
        yield_to_reporter()
    return report.exit_code
