"""The planner's inputs from a recipe and the values a user gives (``launch.plan``'s flags,
``bench/train.py``'s runs), checked: :func:`resolve_inputs`."""

from __future__ import annotations

from collections.abc import Mapping

from offline.plan import Inputs, PlanError
from partial_fc.backbones import list_backbones
from trainer.config import Config, ConfigError, load_config

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
    inp = Inputs(gpus=gpus or asked or (nodes or 1) * per_node, **machine, **values)
    _check(inp)
    return inp


def _check(inp: Inputs) -> None:
    problems = [
        (inp.gpus < 1, f"--gpus={inp.gpus}: need at least 1"),
        (inp.gpus_per_node < 1, f"--gpus-per-node={inp.gpus_per_node}: need at least 1"),
        (inp.classes < inp.gpus, f"--classes={inp.classes}: fewer classes than --gpus="
         f"{inp.gpus} (every GPU holds at least one class)"),
        (not 0 < inp.sample_rate <= 1, f"--sample-rate={inp.sample_rate}: must be in (0, 1]"),
        (inp.dim < 1, f"--dim={inp.dim}: must be >= 1"),
        (inp.subcenters < 1, f"--subcenters={inp.subcenters}: must be >= 1 (1 = off)"),
        (inp.max_tile_mib < 1, f"--max-tile-mib={inp.max_tile_mib}: must be >= 1"),
        (inp.max_update_mib < 1, f"--max-update-mib={inp.max_update_mib}: must be >= 1"),
        (inp.batch < 1, f"--batch={inp.batch}: must be >= 1"),
        (inp.checkpointing < 0, f"--checkpointing={inp.checkpointing}: must be >= 0"),
        (inp.backbone not in list_backbones(),
         f"--backbone={inp.backbone!r}: unknown (valid: {', '.join(list_backbones())})"),
        (inp.engine == "ddp" and inp.precision == "fp16",
         "--precision=fp16: needs --engine=deepspeed"),
        (not inp.gpu_memory > 0, f"--gpu-memory={inp.gpu_memory}: must be > 0 GiB"),
        (not inp.reserve >= 0, f"--reserve={inp.reserve}: must be >= 0 GiB"),
        (not (inp.intra_bw > 0 and inp.inter_bw > 0), "--intra-bw/--inter-bw: must be > 0"),
    ]
    for bad, msg in problems:
        if bad:
            raise PlanError(msg)
