"""The config checks the schema cannot express, each a list of (dotted key, message) pairs.

Three kinds, each its own module: cross-field rules (:func:`semantic_errors`, here, always
run) and the theory checks (:func:`theory_warnings`, here), which only warn; the checks
against the data and the machine (:mod:`trainer.config.resolve`); and what may change when a
run resumes (:mod:`trainer.config.resume_drift`). All are pure, and no check changes the
config it is given. Returning pairs keyed by dotted key, not finished lines, lets
:func:`trainer.config.load_config` name the file that set each key.
"""

from __future__ import annotations

from typing import Any

from partial_fc.head_checks import triton_subcenters_rule
from partial_fc.margins.registry import margin_errors, margin_warnings
from trainer.config.schema import Config
from trainer.yaml_file import shown_value

# The rendezvous (TCPStore) and the first collectives take seconds on a loaded node; a
# timeout below this ends healthy runs at start-up with torch's traceback.
MIN_TIMEOUT_S = 5.0


def fp16_engine_rule(engine: str, precision: str, engine_key: str = "engine.type") -> str | None:
    """Why ``precision`` cannot train on ``engine`` (``engine_key``: how the caller spells
    that setting; ``launch.plan`` says ``--engine``), or None: fp16 needs DeepSpeed's loss
    scaler, and the DDP engine has none (it autocasts to bf16 only)."""
    if engine == "ddp" and precision == "fp16":
        return f"needs {engine_key}=deepspeed (its loss scaler; DDP has none)"
    return None


def semantic_errors(cfg: Config) -> list[tuple[str, str]]:
    """Cross-field checks that the schema alone cannot express: (dotted key, message)."""
    out: list[tuple[str, str]] = []
    m = cfg.margin
    out += margin_errors(cfg.margin_kwargs())  # partial_fc.margins owns the margin rules
    out += _distill_errors(cfg)
    # Accumulation shares one class sample and one head step over the micro-batches
    # (PartialFC.begin_step), so sampling, SphereFace's lambda and the margin warm-up are
    # exact; dynamic AdaCos sets s from each micro-batch's statistics, which no sharing fixes
    # (train.global_batch does: its steps take the statistics over the whole step first,
    # trainer.engine.step_statistics).
    out += _global_batch_errors(cfg)
    if cfg.train.grad_accum > 1 and m.adacos == "dynamic":
        out.append(("train.grad_accum", f"train.grad_accum={cfg.train.grad_accum}: not exact "
                    "with dynamic AdaCos, which updates s from each micro-batch (use "
                    "grad_accum=1, a larger batch, or margin.adacos=fixed)"))
    for key, value, default in (("broadcast_buffers", cfg.engine.broadcast_buffers, True),
                                ("grad_compression", cfg.engine.grad_compression, "none")):
        if cfg.engine.type != "ddp" and value != default:
            out.append((f"engine.{key}", f"engine.{key}={shown_value(value)}: a DDP setting; needs "
                        f"engine.type=ddp (or {key}={shown_value(default)})"))
    if broken := fp16_engine_rule(cfg.engine.type, cfg.engine.precision):
        out.append(("engine.precision", f"engine.precision='fp16': {broken}"))
    if broken := triton_subcenters_rule(cfg.head.kernel, m.subcenters, "margin.subcenters"):
        out.append(("head.kernel", f"head.kernel='triton': {broken}"))
    if (
        cfg.engine.type == "deepspeed"
        and cfg.engine.precision in ("fp16", "bf16")
        and not cfg.engine.zero_stage
    ):
        # Without ZeRO DeepSpeed's fp16/bf16 optimizer keeps its fp32 master weights and
        # optimizer state where checkpoints cannot read them (they would be lost on resume).
        out.append(
            (
                "engine.zero_stage",
                f"engine.zero_stage=0: {cfg.engine.precision} needs ZeRO >= 1 (checkpoints "
                "read its fp32 partitions)",
            )
        )
    if not cfg.checkpoint.resume:
        out.append(("checkpoint.resume", "checkpoint.resume='': use auto, none or a folder"))
    if cfg.dist.timeout_s < MIN_TIMEOUT_S:
        out.append(("dist.timeout_s", f"dist.timeout_s={cfg.dist.timeout_s:g}: below "
                    f"{MIN_TIMEOUT_S:g} s, which the rendezvous and the first collectives "
                    "need even on one node"))
    out += _backbone_errors(cfg)
    out += _data_set_errors(cfg)
    return out


def _global_batch_errors(cfg: Config) -> list[tuple[str, str]]:
    """``train.global_batch`` is whole micro-batches, and replaces ``train.grad_accum``
    (trainer.config.accumulation)."""
    t = cfg.train
    if t.global_batch is None:
        return []
    if t.global_batch % t.batch_size:
        return [("train.global_batch", f"train.global_batch={t.global_batch}: not a multiple "
                 f"of the micro-batch train.batch_size={t.batch_size}")]
    if t.grad_accum != 1:
        return [("train.grad_accum", f"train.grad_accum={t.grad_accum}: give train.global_batch"
                 " or train.grad_accum, not both (with global_batch the accumulation is "
                 "global_batch / (batch_size x ranks))")]
    # ElasticFace draws its margins per forward over that forward's batch (and ElasticFace+
    # ranks them within it): a step of several passes would depend on the world size.
    if cfg.margin.type.startswith("elasticface") and t.global_batch > t.batch_size:
        return [("train.global_batch", f"train.global_batch={t.global_batch}: not with "
                 f"margin.type={cfg.margin.type}, whose margins are drawn per forward, so a "
                 "step would change with the world size; use train.grad_accum")]
    return []


def _distill_errors(cfg: Config) -> list[tuple[str, str]]:
    d = cfg.distill
    if d.embeddings is not None and d.teacher is not None:
        return [("distill.embeddings", "distill.embeddings and distill.teacher are both set: "
                 "give one (offline embeddings, or an online teacher)")]
    if d.embeddings is not None and (cfg.data.source != "shards" or cfg.data.dirs is not None):
        return [("distill.embeddings", "distill.embeddings: needs data.source=shards with one "
                 "data.dir (the embeddings are keyed by its samples)")]
    if d.head_init and (d.embeddings is None or cfg.margin.subcenters > 1):
        return [("distill.head_init", "distill.head_init=true: needs distill.embeddings (the "
                 "class means are taken over them) and margin.subcenters=1")]
    return []


def _data_set_errors(cfg: Config) -> list[tuple[str, str]]:
    """``data.dirs`` replaces ``data.dir``; ``data.weights`` and a list ``data.exclude``
    go with it, one entry per folder, and ``data.merge`` joins classes of its folders."""
    data, out = cfg.data, []
    dirs = data.dirs
    if dirs is not None and not dirs:
        out.append(("data.dirs", "data.dirs=[]: name at least one folder (or use data.dir)"))
    # Against the default, not "was it set": a run folder's config.yaml holds every key, the
    # default data.dir included, and must load again as it was written.
    if dirs is not None and data.dir != schema_default(data, "dir"):
        out.append(("data.dir", f"data.dir={shown_value(data.dir)}"
                                ": give data.dir or data.dirs, not both"))
    if dirs is not None and data.source == "synthetic":
        out.append(("data.dirs", "data.dirs: shard folders are not read with "
                    "data.source=synthetic"))
    n = len(dirs) if dirs else 1
    if data.weights is not None and (dirs is None or len(data.weights) != n):
        out.append(("data.weights", f"data.weights={data.weights}: one weight per folder of "
                    f"data.dirs ({'not set' if dirs is None else f'{n} folders'})"))
    if data.merge is not None and (dirs is None or data.source == "synthetic"):
        out.append(("data.merge", f"data.merge={shown_value(data.merge)}"
                                  ": joins classes of data.dirs "
                    "(a one-folder run: data.dirs=[DIR])"))
    if isinstance(data.exclude, list) and len(data.exclude) != n:
        out.append(("data.exclude", f"data.exclude: {len(data.exclude)} lists for {n} "
                    "folder(s); one path (or null) per folder of data.dirs"))
    elif isinstance(data.exclude, str) and n > 1:
        out.append(("data.exclude", f"data.exclude={shown_value(data.exclude)}"
                                    ": a list names labels of one "
                    f"folder; give a list parallel to data.dirs ({n} folders, null for none)"))
    return out


def schema_default(section: Any, key: str) -> Any:
    """The schema's default of ``section.key``."""
    return type(section).model_fields[key].get_default(call_default_factory=True)


def _backbone_errors(cfg: Config) -> list[tuple[str, str]]:
    """``partial_fc.backbones.backbone_errors`` on the section, each under the key it names."""
    from partial_fc.backbones import backbone_errors

    b = cfg.backbone
    out = []
    for msg in backbone_errors(**b.build_kwargs()):
        keys = ("checkpointing", "depth", "drop_path", "mask_ratio")
        key = next((k for k in keys if msg.startswith(k)), "name")
        if key != "name":  # "depth=3: why" -> "why": the line names the key itself
            msg = msg.split(": ", 1)[-1]
        out.append((f"backbone.{key}", f"backbone.{key}={shown_value(getattr(b, key))}: {msg}"))
    return out


def theory_warnings(cfg: Config) -> list[str]:
    """The theory checks (``partial_fc.margins.registry.margin_warnings``) as one string each; empty
    while ``data.num_classes`` is unknown."""
    if cfg.data.num_classes is None:
        return []
    return margin_warnings(cfg.margin_kwargs(), cfg.data.num_classes, cfg.margin.p_w)
