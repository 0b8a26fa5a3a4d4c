"""Write the partial-fc run folder an arcface_torch output folder becomes (one process).

``offline.insightface.checkpoint`` reads and checks the files; this module settles the run's
config (the ``--config`` file, a partial-fc YAML or an arcface_torch ``.py``, then what the
files say: architecture, classes, optimizer, schedule; then the overrides) and writes
``OUT/config.yaml`` and the checkpoint through the trainer's own engine and storage.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from offline.insightface import checkpoint as shards_io
from offline.insightface.backbones import ImportRefused, convert_state
from offline.insightface.config import arcface_torch_behaviour, put, read_config
from trainer.config import Config, ConfigError
from trainer.config.files import CLI, apply_overrides, load_tree, schema_errors, shown
from trainer.config.schema import dump_config


def _get(tree: dict, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def start_tree(config: Path | None) -> tuple[dict, dict[str, str], str | None]:
    """``(config tree, origin of each key, arcface_torch network name or None)`` from
    ``--config``: an arcface_torch ``.py`` (converted without running it) or a partial-fc
    YAML; without one, arcface_torch's fixed behaviour (its base.py margin, ArcFace 0.5 at
    scale 64, is the schema's default)."""
    origin: dict[str, str] = {}
    if config is None:
        tree: dict = {}
        for key, value in arcface_torch_behaviour().items():
            put(tree, key, value)
        return tree, origin, None
    if config.suffix == ".py":
        converted = read_config(config)
        return converted.tree, converted.origin, converted.network
    return load_tree(config, origin), origin, None


def finish_config(tree: dict, origin: dict[str, str], facts: dict[str, Any],
                  overrides: list[str], top: str) -> Config:
    """``facts`` (from the files: they win over the config file) and ``overrides`` (win over
    both) applied to ``tree``, validated; refuses with every problem at once."""
    for key, value in facts.items():
        put(tree, key, value)
        origin[key] = "the imported files"
    put(tree, "margin.gradient", _get(tree, "margin.gradient") or "straight_through")
    errors = apply_overrides(tree, overrides, origin)
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as err:
        errors += schema_errors(err, origin, top)
        cfg = None
    if errors:
        raise ConfigError("\n".join(errors))
    return cfg


def _architecture(tree: dict, network: str | None) -> dict[str, Any]:
    """``convert_state``'s choice of architecture: the arcface_torch config's network, else
    a YAML config's backbone, else none (the file's keys decide)."""
    return {"network": network, "ours": None if network else _get(tree, "backbone.name"),
            "depth": _get(tree, "backbone.depth")}


def import_run(src: Path, out: Path, config: Path | None, overrides: list[str]) -> list[str]:
    """``src``'s arcface_torch checkpoints -> run folder ``out`` (its config.yaml and one
    checkpoint at arcface_torch's step); returns the lines to print."""
    tree, origin, network = start_tree(config)
    paths = shards_io.shard_paths(src)
    shards = shards_io.read_shards(paths, _get(tree, "data.num_classes"),
                                   _architecture(tree, network))
    grad_accum = _get(tree, "train.grad_accum") or 1
    facts = {"backbone.name": shards.network, "backbone.embedding_size": shards.embedding_size,
             "data.num_classes": int(shards.head.shape[0]), "optim.name": shards.optimizer,
             "output": str(out), "name": _get(tree, "name") or out.name,
             **shards_io.schedule_settings(shards, grad_accum)}
    cfg = finish_config(tree, origin, facts, overrides, shown(config) if config else CLI)
    step = shards.global_step // grad_accum
    path = _save(cfg, shards, step)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(cfg))
    moments = ", ".join(sorted(shards.head_state)) or "none (fresh)"
    return [f"{src}: {len(paths)} shard(s), {cfg.data.num_classes} classes, "
            f"{shards.network}, step {step}, epoch {shards.epoch}; head optimizer state: "
            f"{moments}",
            f"wrote {path} and {out / 'config.yaml'}",
            f"resume on any number of ranks: python -m launch.train --config "
            f"{out / 'config.yaml'} data.dir=YOUR_SHARDS"]


def import_model(src: Path, out: Path, config: Path | None, overrides: list[str]) -> list[str]:
    """``src/model.pt`` alone -> a backbone-only run folder ``out`` (for launch.evaluate,
    launch.export) whose config.yaml fine-tunes it with a new head into ``out/finetune``."""
    tree, origin, network = start_tree(config)
    model = src / "model.pt"
    name, size, state, _ = convert_state(shards_io.load(model), str(model),
                                         **_architecture(tree, network))
    weights = shards_io.write_backbone_only(out, state, model)
    facts = {"backbone.name": name, "backbone.embedding_size": size,
             "backbone.weights": os.path.abspath(weights), "output": str(out / "finetune"),
             # a new head: the fine-tuning data's manifest sizes it, not the old run's count
             "data.num_classes": None, "data.num_samples": None,
             "name": _get(tree, "name") or f"{out.name}-finetune"}
    cfg = finish_config(tree, origin, facts, overrides, shown(config) if config else CLI)
    (out / "config.yaml").write_text(dump_config(cfg))
    return [f"{model}: {name}, embedding size {size}",
            f"wrote {weights} and {out / 'config.yaml'}",
            f"evaluate: python -m launch.evaluate --checkpoint {out} --bin ...; export: python "
            f"-m launch.export --checkpoint {out} --out model.onnx; fine-tune: python -m "
            f"launch.train "
            f"--config {out / 'config.yaml'} data.dir=YOUR_SHARDS"]


def _save(cfg: Config, shards: shards_io.Shards, step: int) -> Path:
    """The checkpoint, written by ``trainer.checkpoint.save`` from a one-process engine: DDP in
    fp32 whatever ``cfg.engine`` says, as checkpoints hold the full form any engine reads."""
    import torch.distributed as dist

    from partial_fc import PartialFC, build_margin
    from partial_fc.backbones import build_backbone
    from trainer import checkpoint
    from trainer.checkpoint import state
    from trainer.dist import init_distributed
    from trainer.engine import Engine

    started = not dist.is_initialized()
    env = init_distributed("cpu", cfg.dist.timeout_s)
    try:
        backbone = build_backbone(**cfg.backbone.build_kwargs())
        head = PartialFC(cfg.backbone.embedding_size, cfg.data.num_classes,
                         build_margin(cfg.margin_kwargs()), process_group=env.group,
                         seed=cfg.seed, **cfg.partial_fc_kwargs())
        writer = Config.model_validate({**cfg.model_dump(), "engine": {
            **cfg.engine.model_dump(), "type": "ddp", "precision": "fp32", "compile": False}})
        engine = Engine(writer, backbone, head, env, total_steps=max(step, 1), warmup_steps=0)
        flat = {f"head.{k}": v for k, v in engine.head.state_dict().items()}
        flat["head.weight"] = shards.head.to(engine.head.weight.dtype)
        flat["head.step"] = torch.tensor(step, dtype=torch.int64)
        flat.update({f"head_opt.{k}": v for k, v in shards.head_state.items()})
        flat.update({f"backbone.{k}": v for k, v in shards.backbone.items()})
        flat.update(shards.backbone_state)
        try:
            state.restore(engine, flat)
        except RuntimeError as exc:
            raise ImportRefused(f"the imported state does not fit {cfg.backbone.name}: "
                                f"{str(exc).splitlines()[0]}") from None
        # Without data.num_samples the training run fills it, so the configs would not compare.
        config = cfg.model_dump(mode="json") if cfg.data.num_samples is not None else None
        record = checkpoint.RunRecord(loader=shards_io.loader_position(shards.epoch),
                                      name=cfg.name, config=config)
        return checkpoint.save(cfg.run_dir, step, engine, record, cfg.checkpoint.keep)
    finally:
        if started:
            dist.destroy_process_group()
