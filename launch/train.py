"""``python -m launch.train --config FILE [key=value ...]``: the one training entry point.

Single process: ``python -m launch.train --config configs/smoke.yaml``. Several ranks:
``torchrun --nproc_per_node N -m launch.train ...``; several nodes: ``torchrun --nnodes M
--node_rank i --rdzv_backend c10d --rdzv_endpoint HOST:PORT ...`` (or ``make <recipe>``).
The config is loaded and validated (schema, data manifest, device) before any process
group starts. The run folder (``output``, default ``runs/<name>``) receives config.yaml,
metrics.jsonl, checkpoints/ and W&B files; an existing checkpoint there is resumed from
(``checkpoint.resume=auto``), on any number of ranks.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import warnings
from collections.abc import Iterator

import torch

from launch import checkpoint
from launch.config import (
    Config,
    ConfigError,
    ConfigWarning,
    dump_config,
    load_config,
    resume_drift,
)
from launch.distributed import DistEnv, init_distributed, shutdown
from launch.logging import RunLogger, print_main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m launch.train",
        description="Train a face-embedding backbone with a sharded margin-softmax head.",
        epilog="Overrides are dotted keys of the schema in launch/config.py, values in YAML "
        "syntax, e.g. margin.type=cosface margin.m=0.35 optim.lr=0.05 "
        "eval.bins=[lfw.bin,cfp_fp.bin]. Recipes: configs/*.yaml.",
    )
    parser.add_argument("--config", required=True, help="YAML recipe (may say base: FILE)")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser.parse_args(argv)


def _groups(batches, k: int) -> Iterator[list]:
    """Consecutive groups of ``k`` loader batches (one optimisation step each)."""
    it = iter(batches)
    while group := list(itertools.islice(it, k)):
        if len(group) == k:
            yield group


class Diverged(RuntimeError):
    """``train.max_bad_steps`` steps in a row had a non-finite loss or gradient."""


def train(cfg: Config, env: DistEnv) -> dict:
    """Run (or resume) training on every rank; returns rank 0's summary (``{}`` elsewhere)."""
    from data_pipeline import make_loader
    from launch.engine import Engine
    from launch.evaluate import evaluate_bins
    from partial_fc import PartialFC, build_margin
    from partial_fc import distributed as pd
    from partial_fc.backbones import build_backbone

    torch.manual_seed(cfg.seed)  # identical backbone init on every rank
    backbone = build_backbone(cfg.backbone.name, cfg.backbone.embedding_size, cfg.backbone.dropout)
    head = PartialFC(
        cfg.backbone.embedding_size,
        cfg.data.num_classes,
        build_margin(cfg.margin_kwargs()),
        sample_rate=cfg.head.sample_rate,
        seed=cfg.seed,
    )
    k = cfg.train.grad_accum
    loader = make_loader(
        cfg.data.dir,
        batch_size=cfg.train.batch_size,
        rank=env.rank,
        world_size=env.world_size,
        seed=cfg.seed,
        num_workers=cfg.data.num_workers,
        flip=cfg.data.flip,
    )
    steps_per_epoch = len(loader) // k
    if steps_per_epoch == 0:
        raise ConfigError(f"train.grad_accum={k}: more than the {len(loader)} batches per epoch")
    total = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps is not None:
        total = min(total, cfg.train.max_steps)
    warmup = round(cfg.schedule.warmup_epochs * steps_per_epoch)
    engine = Engine(cfg, backbone, head, env.device, total_steps=total, warmup_steps=warmup)
    log = RunLogger(cfg, env.rank, total, cfg.train.batch_size * k * env.world_size)
    step, epoch, saved = 0, 0, None
    bad_steps = bad_in_a_row = 0
    resume = checkpoint.find_resume(cfg.run_dir, cfg.checkpoint.resume)
    if env.is_main:
        checkpoint.remove_stale(cfg.run_dir)
    if resume is not None:
        changed = resume_drift(checkpoint.read_meta(resume).get("config"), cfg, str(resume))
        if changed:
            log.info(f"resuming with changed settings: {', '.join(changed)}")
        meta = checkpoint.load(resume, engine)
        step = meta["step"]
        loader.load_state_dict(meta["loader"])
        epoch = loader.epoch + (len(loader) - loader.batches_done < k)  # finished: next epoch
        log.info(f"resumed from {resume} at step {step} (saved on {meta['world_size']} ranks)")
    else:
        torch.manual_seed(cfg.seed + 1 + env.rank)  # per-rank stream (dropout), from the seed
    log.info(
        f"{cfg.name}: {env.world_size} rank(s) on {env.device.type}, {total} steps, "
        f"{steps_per_epoch} steps/epoch, C={cfg.data.num_classes}, "
        f"engine={cfg.engine.type}, dropped {loader.dropped_fraction:.2%} of each epoch"
    )

    def data_counts() -> dict[str, int]:
        """Collective: corrupt samples skipped and samples repeated to pad, over all ranks."""
        counts = pd.gather_ints([loader.num_skipped, loader.num_padded], env.device).sum(0)
        return {"skipped_samples": int(counts[0]), "padded_samples": int(counts[1]),
                "bad_steps": bad_steps}

    def save() -> None:
        nonlocal saved
        meta = {"loader": loader.state_dict(), "name": cfg.name,
                "config": cfg.model_dump(mode="json")}
        saved = checkpoint.save(cfg.run_dir, step, engine, meta, cfg.checkpoint.keep)

    def evaluate() -> None:
        with engine.eval_context():
            results = evaluate_bins(engine.backbone, cfg.eval.bins, cfg.eval.batch_size, env.device)
        log.evaluation(step, results)

    log.start(step)
    while step < total:
        loader.set_epoch(epoch)  # the same epoch again keeps a resumed position
        for micro_batches in _groups(loader, k):
            hist = (step + 1) % cfg.log.hist_every == 0
            stats = engine.step(step, micro_batches, angles=hist)
            step += 1
            if stats["skipped"]:  # the same on every rank
                bad_steps, bad_in_a_row = bad_steps + 1, bad_in_a_row + 1
            else:
                bad_in_a_row = 0
            log.step(step, stats, head.stats, data_counts() if log.due(step) else None,
                     env.device)
            if hist:
                log.histograms(step, stats["angles"])
            if bad_in_a_row:  # all ranks raise together
                log.info(f"step {step}: non-finite loss or gradient (loss {stats['loss']:.4g}, "
                         f"grad norm {stats['grad_norm']:.4g}); skipped on every rank")
            if bad_in_a_row >= cfg.train.max_bad_steps:
                raise Diverged(
                    f"step {step}: {bad_in_a_row} steps in a row had a non-finite loss or "
                    f"gradient (train.max_bad_steps={cfg.train.max_bad_steps}); the run "
                    f"diverges: lower optim.lr or margin.s, or resume from "
                    f"{saved or 'the start'} with other settings"
                )
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < total:
                save()
            if cfg.eval.bins and step % cfg.eval.every == 0 and step < total:
                evaluate()
            if step >= total:
                break
        epoch += 1
    if saved is None or saved.name != checkpoint.tag_for(step):
        save()
    if cfg.eval.bins:
        evaluate()
    return log.close(step, saved)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConfigWarning)
            cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"config error:\n{err}", file=sys.stderr)
        return 2
    for w in caught:
        print_main(f"warning: {w.message}")
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    env = init_distributed(cfg.device)
    try:
        train(cfg, env)
    except ConfigError as err:  # found with the data or the checkpoint; all ranks alike
        print_main(f"config error: {err}")
        return 2
    except (Diverged, checkpoint.CheckpointError) as err:  # all ranks raise it together
        print_main(f"error: {err}")
        return 1
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
