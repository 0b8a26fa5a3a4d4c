"""The planner's inputs from a recipe and the values a user gives (``launch.plan``'s flags,
``bench/train.py``'s runs), checked: :func:`resolve_inputs`."""

from __future__ import annotations

from collections.abc import Mapping

from offline.plan import Inputs, PlanError
from partial_fc import build_margin
from partial_fc.backbones import list_backbones
from partial_fc.head_checks import SAMPLE_RATE, SUBCENTERS
from trainer.config import Config, ConfigError, load_config
from trainer.config.checks import fp16_engine_rule
from trainer.engine.step_statistics import moves_statistics

FROM_RECIPE = {  # input -> the recipe key supplying it (trainer.config's schema: the defaults)
    "classes": "data.num_classes",
    "sample_rate": "head.sample_rate",
    "dim": "backbone.embedding_size",
    "batch": "train.batch_size",
    "backbone": "backbone.name",
    "optimizer": "optim.name",
    "precision": "engine.precision",
    "engine": "engine.type",
    "zero_stage": "engine.zero_stage",
    "max_tile_mib": "head.max_tile_mib",
    "max_update_mib": "head.max_update_mib",
    "state_dtype": "head.state_dtype",
    "checkpointing": "backbone.checkpointing",
    "subcenters": "margin.subcenters",
    "global_batch": "train.global_batch",
}
MACHINE = {"gpus_per_node": 8, "gpu_memory": 80.0, "reserve": 2.0, "intra_bw": 450.0,
           "inter_bw": 50.0, "latency_us": 10.0, "row_sparse_grad": True}
"""The machine's inputs and their defaults (8 GPUs of 80 GiB per node, NVLink 4 within a
node, 400 Gb/s between nodes)."""


def resolve_inputs(config: str | None, given: Mapping[str, object],
                   gpus: int | None = None) -> Inputs:
    """The recipe ``config``'s values (the schema's defaults without one), then ``given``
    (keys of :data:`FROM_RECIPE` and :data:`MACHINE`, plus ``gpus`` and ``nodes``; a None
    value is not given); ``gpus`` overrides both. Raises :class:`PlanError` (one line naming
    the flag) for impossible inputs."""
    try:
        cfg = load_config(config, resolve=False) if config else Config()
    except ConfigError as e:
        raise PlanError(str(e)) from None
    values = {}
    for key, path in FROM_RECIPE.items():
        value = given.get(key)
        if value is None:
            value = cfg
            for part in path.split("."):
                value = getattr(value, part)
        values[key] = value
    machine = {k: given[k] if given.get(k) is not None else v for k, v in MACHINE.items()}
    if values["classes"] is None and cfg.data.dirs:  # the sum of their classes, if at hand
        from trainer.config.on_disk import read_data_manifest

        manifest, problems = read_data_manifest(cfg)
        if problems:  # a folder or URL without a readable manifest: its one line
            raise PlanError(f"--config {config}: {problems[0][1]}; or give --classes")
        values["classes"] = manifest.num_classes
    if values["classes"] is None:
        raise PlanError("--classes: required (the recipe's data.num_classes is not set)")
    asked, nodes, per_node = given.get("gpus"), given.get("nodes"), machine["gpus_per_node"]
    if asked and nodes and asked != nodes * per_node:
        raise PlanError(f"--gpus={asked}: not --nodes={nodes} x --gpus-per-node={per_node}; "
                        "give one or the other")
    inp = Inputs(gpus=gpus or asked or (nodes or 1) * per_node, **machine, **values,
                 statistics_pass=moves_statistics(build_margin(cfg.margin_kwargs())))
    _check(inp)
    return inp


def _check(inp: Inputs) -> None:
    """Raise :class:`PlanError` on the first impossible input, ``--flag=value: why``; the rules
    a head or a run states too are theirs (``partial_fc.head_checks``,
    ``trainer.config.checks``), so both paths say the same."""
    def least(value: float, low: float) -> str | None:
        return None if value >= low else f"must be >= {low}"

    problems = [
        ("--gpus", inp.gpus, None if inp.gpus >= 1 else "need at least 1"),
        ("--gpus-per-node", inp.gpus_per_node, None if inp.gpus_per_node >= 1 else
         "need at least 1"),
        ("--classes", inp.classes, None if inp.classes >= inp.gpus else
         f"fewer classes than --gpus={inp.gpus} (every GPU holds at least one class)"),
        ("--sample-rate", inp.sample_rate, SAMPLE_RATE.rule(inp.sample_rate)),
        ("--dim", inp.dim, least(inp.dim, 1)),
        ("--subcenters", inp.subcenters, SUBCENTERS.rule(inp.subcenters)),
        ("--max-tile-mib", inp.max_tile_mib, least(inp.max_tile_mib, 1)),
        ("--max-update-mib", inp.max_update_mib, least(inp.max_update_mib, 1)),
        ("--batch", inp.batch, least(inp.batch, 1)),
        ("--global-batch", inp.global_batch, None if inp.global_batch is None
         or (inp.global_batch >= 1 and inp.global_batch % max(inp.batch, 1) == 0) else
         f"not a positive multiple of the micro-batch --batch={inp.batch}"),
        ("--checkpointing", inp.checkpointing, least(inp.checkpointing, 0)),
        ("--backbone", repr(inp.backbone), None if inp.backbone in list_backbones() else
         f"unknown (valid: {', '.join(list_backbones())})"),
        ("--precision", inp.precision, fp16_engine_rule(inp.engine, inp.precision, "--engine")),
        ("--gpu-memory", inp.gpu_memory, None if inp.gpu_memory > 0 else "must be > 0 GiB"),
        ("--reserve", inp.reserve, None if inp.reserve >= 0 else "must be >= 0 GiB"),
    ]
    for flag, value, broken in problems:
        if broken:
            raise PlanError(f"{flag}={value}: {broken}")
    if not (inp.intra_bw > 0 and inp.inter_bw > 0):
        raise PlanError("--intra-bw/--inter-bw: must be > 0")
