"""A run's construction: :func:`build` turns a checked config into the :class:`Run` of this
rank (backbone, head, loader, engine, logger, identically seeded on every rank), and
:func:`build_loader` into its batches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer import seams
from trainer.config import Config, ConfigError
from trainer.config.accumulation import accumulation, images_per_step, micro_batches
from trainer.dist import DistEnv
from trainer.overrules import epochs_end_first, run_length
from trainer.run_state import Run
from trainer.stopping import StopRequests
from trainer.telemetry.logger import RunLogger

if TYPE_CHECKING:
    from data_pipeline.epoch_batches import EpochBatches


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
