"""The config checks the schema cannot express, each a list of (dotted key, message) pairs.

Three kinds: cross-field rules (:func:`semantic_errors`, always run); checks against the data
and the machine (:func:`resolve_config`: the manifest's sizes, the launch's ranks, CUDA, the
optional packages), run before any process group starts so a run fails in one report rather
than on one rank; and the theory checks (:func:`theory_warnings`), which only warn. All are
pure: the machine is a :class:`~trainer.config.machine.Machine` snapshot and the manifest a
value, both read at the edge (:meth:`Machine.observe`, :mod:`trainer.config.on_disk`), and
no check changes the config it is given. Returning pairs keyed by dotted key, not finished
lines, lets :func:`trainer.config.load_config` name the file that set each key.
:func:`resume_drift` compares a checkpoint's config with the current one when a run resumes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from partial_fc.head_checks import triton_subcenters_rule
from partial_fc.margins.registry import effective, margin_errors, margin_warnings, read_keys
from trainer.config.accumulation import micro_batches, world_size_error
from trainer.config.head_memory import head_memory_errors
from trainer.config.machine import Machine
from trainer.config.schema import Config, ConfigError
from trainer.yaml_file import shown_value

if TYPE_CHECKING:
    from data_pipeline.manifest import Manifest

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
    if dirs is not None and data.dir != _default(data, "dir"):
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


def _default(section: Any, key: str) -> Any:
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


def _sink_errors(cfg: Config, machine: Machine) -> list[tuple[str, str]]:
    """The optional logging packages a run will import (``WANDB_MODE`` wins, as in training)."""
    out = []
    if cfg.log.tensorboard and not machine.has("tensorboard"):
        out.append(("log.tensorboard", "log.tensorboard=true: the tensorboard package is not "
                    "installed (pip install 'partial-fc[tensorboard]', or log.tensorboard=false)"))
    if (machine.wandb_mode or cfg.log.wandb) != "disabled" and not machine.has("wandb"):
        out.append(("log.wandb", f"log.wandb={shown_value(cfg.log.wandb)}"
                                 ": the wandb package is not "
                    "installed (pip install 'partial-fc[wandb]', or log.wandb=disabled)"))
    return out


class Resolved(NamedTuple):
    """What :func:`resolve_config` returns: the config with the data's sizes filled in, and
    the (dotted key, message) pairs the data and the machine refuse."""

    cfg: Config
    errors: list[tuple[str, str]]


def resolve_config(cfg: Config, manifest: Manifest | None, machine: Machine) -> Resolved:
    """Check ``cfg`` against the data (``manifest``: ``data.dir``'s, None for synthetic data or
    when there is none) and ``machine``; a new config with ``data.num_classes/num_samples``
    filled from the manifest or the synthetic settings. Pure: reads nothing else (the files
    are :mod:`trainer.config.on_disk`'s) and leaves ``cfg`` as it was."""
    cfg, out = _sized(cfg, manifest)
    out += _sink_errors(cfg, machine)
    out += _batch_errors(cfg, machine) + _class_errors(cfg, machine) + _batch_norm_errors(cfg)
    out += _device_errors(cfg, machine)
    return Resolved(cfg, out)


def _sized(cfg: Config, manifest: Manifest | None) -> Resolved:
    """A copy of ``cfg`` with ``data.num_classes/num_samples`` from the manifest (shards) or
    the synthetic settings, and what contradicts them."""
    data, out, fill = cfg.data, [], {}
    if data.source == "synthetic":
        if data.num_classes is None:
            return Resolved(cfg, [("data.num_classes", "data.num_classes: required with "
                                   "data.source=synthetic (the identities to generate, e.g. "
                                   "data.num_classes=1000000)")])
        if data.num_classes >= 1 << 31:
            out.append(("data.num_classes", f"data.num_classes={data.num_classes}: "
                        "data.source=synthetic generates fewer than 2^31 identities"))
        want = data.num_classes * data.synthetic_images_per_class
        if data.num_samples is None:
            fill["num_samples"] = want
        elif data.num_samples != want:
            per_class = max(1, round(data.num_samples / data.num_classes))
            out.append(("data.num_samples", f"data.num_samples={data.num_samples}: data.source="
                        f"synthetic makes num_classes x synthetic_images_per_class = {want}; "
                        "a recipe's count: add data.num_samples=null (and e.g. "
                        f"data.synthetic_images_per_class={per_class})"))
    else:
        if data.synthetic_images_per_class != _default(data, "synthetic_images_per_class"):
            out.append(("data.synthetic_images_per_class", "data.synthetic_images_per_class="
                        f"{data.synthetic_images_per_class}: only read with data.source="
                        "synthetic (data.source='shards'; drop the key, or give "
                        "data.synthetic_images_per_class=null for its default)"))
        for key in ("num_classes", "num_samples") if manifest is not None else ():
            have, want = getattr(data, key), getattr(manifest, key)
            if have is None:
                fill[key] = want
            elif have != want:
                where = ", ".join(str(Path(d)) for d in data.folders())
                out.append((f"data.{key}", f"data.{key}={have}: manifest.json in {where} says "
                            f"{want}" + (" (their sum)" if data.dirs else "") +
                            f"; set data.{key}={want} or drop the key (the manifest fills it)"))
    if not fill:
        return Resolved(cfg, out)
    sized = cfg.model_copy(update={"data": data.model_copy(update=fill, deep=True)}, deep=True)
    return Resolved(sized, out)


def _device_errors(cfg: Config, machine: Machine) -> list[tuple[str, str]]:
    """What this machine cannot run: a CUDA device it does not have, fp16 off the GPU, the
    GPU's own limits (:func:`_gpu_errors`), optional packages the config needs."""
    out = []
    if cfg.device == "cuda" and not machine.cuda:
        out.append(("device", "device='cuda': no CUDA device on this machine (the GPU "
                    "recipes set it; add device=cpu to train on the CPU instead)"))
    on_gpu = cfg.device in ("cuda", "auto") and machine.cuda
    if cfg.engine.precision == "fp16" and not on_gpu:
        out.append(("engine.precision", "engine.precision='fp16': needs a CUDA device"))
    out += _gpu_errors(cfg, machine) if on_gpu else []
    if cfg.engine.type == "deepspeed" and not machine.has("deepspeed"):
        out.append(("engine.type", "engine.type='deepspeed': DeepSpeed is not installed "
                    "(pip install 'partial-fc[deepspeed]', or engine.type=ddp)"))
    if cfg.head.kernel == "triton" and not machine.has("triton"):
        out.append(("head.kernel", "head.kernel='triton': triton is not installed "
                    "(pip install triton, or head.kernel=auto)"))
    return out


def _gpu_errors(cfg: Config, machine: Machine) -> list[tuple[str, str]]:
    """What this node's GPUs cannot run: more ranks than GPUs (two ranks cannot share one GPU
    under NCCL), bf16 without hardware support, several ranks without NCCL."""
    out = []
    gpus, ranks = machine.gpus, machine.local_ranks
    if ranks > gpus:
        out.append(("device", f"device={shown_value(cfg.device)}"
                              f": {ranks} ranks on this node but {gpus} "
                    f"GPU(s) visible: launch --nproc_per_node {gpus} (make NPROC_PER_NODE="
                    f"{gpus}) or set device=cpu"))
    if cfg.engine.precision == "bf16" and gpus and not machine.bf16:
        out.append(("engine.precision", "engine.precision='bf16': this GPU has no bf16 support "
                    "(before Ampere); use fp16 with engine.type=deepspeed, or fp32"))
    if machine.world_size > 1 and not machine.nccl:
        out.append(("device", f"device={shown_value(cfg.device)}"
                              ": this torch build has no NCCL, which "
                    "multi-GPU runs need; install a CUDA build of torch with NCCL"))
    return out


def _batch_errors(cfg: Config, machine: Machine) -> list[tuple[str, str]]:
    """A batch the data cannot fill on every rank of the launch."""
    from data_pipeline.epoch_plan import batches_per_rank

    n = cfg.data.num_samples
    if cfg.train.global_batch is not None:
        return _global_batch_fit(cfg, machine)
    world = machine.world_size
    batch, k = cfg.train.batch_size, cfg.train.grad_accum
    if n is None or batches_per_rank(n, world, batch) >= k:
        return []
    key = "train.batch_size" if batches_per_rank(n, world, batch) == 0 else "train.grad_accum"
    where = _data_named(cfg)
    fits = next((b for b in range(batch - 1, 0, -1) if batches_per_rank(n, world, b) >= k), 0)
    fix = (f"train.batch_size={fits} is the largest that fits" if fits else
           f"even train.batch_size=1 needs {world * k} samples")
    return [(key, f"train.batch_size={batch} x grad_accum={k} on {world} rank(s): the "
                  f"{n} samples in {where} cannot fill one step (at most "
                  f"{n // world} samples per rank); {fix}, or add data or launch fewer ranks")]


def _global_batch_fit(cfg: Config, machine: Machine) -> list[tuple[str, str]]:
    """A ``train.global_batch`` step the launch's ranks cannot split, or the data cannot fill
    (its micro-batch streams are planned as ``n`` ranks of one micro-batch each,
    data_pipeline.micro_batches, whatever the world size)."""
    from data_pipeline.epoch_plan import batches_per_rank

    t, n = cfg.train, cfg.data.num_samples
    if t.global_batch % t.batch_size:
        return []  # semantic_errors says so
    if broken := world_size_error(t, machine.world_size):
        return [("train.global_batch", broken)]
    if n is None or batches_per_rank(n, micro_batches(t), t.batch_size):
        return []
    return [("train.global_batch", f"train.global_batch={t.global_batch}: the {n} samples in "
             f"{_data_named(cfg)} cannot fill one step; lower it, or add data")]


def _data_named(cfg: Config) -> str:
    """The data as an error names it: its folders, or the synthetic data."""
    return "the synthetic data" if cfg.data.source == "synthetic" else \
        ", ".join(cfg.data.folders())


def _class_errors(cfg: Config, machine: Machine) -> list[tuple[str, str]]:
    """Every rank owns a contiguous block of at least one class (``PartialFC``), and a softmax
    over one class has nothing to tell apart (its loss is 0 whatever the backbone does)."""
    classes, world = cfg.data.num_classes, machine.world_size
    if classes is None:
        return []
    if classes < 2:
        return [("data.num_classes", f"data.num_classes={classes}: a margin softmax needs at "
                 "least 2 classes (with 1 the loss is 0 and nothing trains)")]
    if classes < world:
        return [("data.num_classes", f"data.num_classes={classes}: fewer classes than the "
                 f"{world} ranks, each of which holds a block of at least one class; launch "
                 f"at most {classes} ranks")]
    return head_memory_errors(cfg, machine)



def _batch_norm_errors(cfg: Config) -> list[tuple[str, str]]:
    """A micro-batch of one image cannot train a ``BatchNorm1d`` (the embedding layer of every
    face backbone here): torch refuses one value per channel in training mode."""
    if cfg.train.batch_size > 1:
        return []
    import torch
    from torch import nn

    from partial_fc.backbones import build_backbone, list_backbones

    if cfg.backbone.name not in list_backbones():  # reported by semantic_errors
        return []
    with torch.device("meta"):
        model = build_backbone(**cfg.backbone.build_kwargs())
    if not any(isinstance(m, nn.BatchNorm1d) for m in model.modules()):
        return []
    name = shown_value(cfg.backbone.name)
    return [("train.batch_size", f"train.batch_size=1: backbone.name={name} has BatchNorm1d, "
             "which cannot train on one image per rank; use a batch of 2 or more")]


# Keys whose change makes a checkpoint a different model (or an incompatible optimizer
# state): resuming across them is refused. Every other key may change, with a note.
# backbone.checkpointing may change (the same model and steps); backbone.depth may not.
MODEL_KEYS = ("backbone.name", "backbone.embedding_size", "backbone.dropout", "backbone.depth",
              "margin", "data.num_classes", "data.num_samples", "data.merge_digest",
              "optim.name", "engine.type")
NOT_COMPARED = ("name", "output", "checkpoint.resume", "margin.p_w")


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _margin_as_read(tree: dict) -> dict:
    """``tree`` with its margin section as the margin reads it (``partial_fc.margins``'
    ``effective``: the type's keys, defaults filled), so that the other types' keys a
    checkpoint's flat section held and a null meaning the default that was then in force
    compare equal; left as written when the section is not valid today."""
    margin = read_keys({k: v for k, v in (tree.get("margin") or {}).items() if k != "p_w"})
    if not margin or margin_errors(margin):
        return tree
    return {**tree, "margin": {**effective(margin), "p_w": tree["margin"].get("p_w")}}


def resume_drift(saved: dict | None, cfg: Config, where: str) -> list[str]:
    """Compare the config a checkpoint was saved with (``saved``, as :func:`dump_config`
    wrote it) to ``cfg``; return notes on the schedule keys that changed.

    Raises :class:`ConfigError` (one line, every model-defining difference, the way out)
    when the checkpoint at ``where`` was trained as another model. ``train.batch_size`` and
    the world size may change: the loader resumes at the same fraction of its epoch (see
    ``data_pipeline.loader``) and the LR schedule counts steps.
    """
    if saved is None:
        return ["none compared (the checkpoint holds no config)"]
    old = _flatten(_margin_as_read(saved))
    new = _flatten(_margin_as_read(cfg.model_dump(mode="json")))
    changed = [
        f"{key} {shown_value(old.get(key))} -> {shown_value(new.get(key))}"
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key) and not key.startswith(NOT_COMPARED)
    ]
    model = [c for c in changed if c.split(" ")[0].startswith(MODEL_KEYS)]
    if model:
        raise ConfigError(
            f"{where} was trained as another model: {', '.join(model)}; resume it with its "
            f"own settings, or start over with checkpoint.resume=none or another name"
        )
    return changed

