"""The config checks the schema cannot express, each a list of (dotted key, message) pairs.

Three kinds: cross-field rules (:func:`semantic_errors`, always run); checks against the data
and this machine (:func:`resolve_errors`: the manifest, CUDA, optional packages, the run
folder), run before any process group starts so a run fails in one report rather than on
one rank; and the theory checks (:func:`theory_warnings`), which only warn. Returning
pairs keyed by dotted key, not finished lines, lets :func:`trainer.config.load_config` name
the file that set each key. :func:`resume_drift` compares a checkpoint's config with the
current one when a run resumes.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from partial_fc.margins import margin_errors, margin_warnings
from trainer.config.schema import Config, ConfigError, ConfigWarning

# The rendezvous (TCPStore) and the first collectives take seconds on a loaded node; a
# timeout below this ends healthy runs at start-up with torch's traceback.
MIN_TIMEOUT_S = 5.0


def semantic_errors(cfg: Config) -> list[tuple[str, str]]:
    """Cross-field checks that the schema alone cannot express: (dotted key, message)."""
    out: list[tuple[str, str]] = []
    m = cfg.margin
    out += margin_errors(cfg.margin_kwargs())  # partial_fc.margins owns the margin rules
    if cfg.train.grad_accum > 1:
        why = []
        if cfg.head.sample_rate < 1:
            why.append(f"head.sample_rate={cfg.head.sample_rate} samples classes per micro-batch")
        if m.adacos == "dynamic":
            why.append("dynamic AdaCos updates s from each micro-batch")
        if m.type == "sphereface":
            why.append("the SphereFace lambda schedule advances per forward")
        if m.warmup_steps:
            why.append(f"margin.warmup_steps={m.warmup_steps} ramps the margin per forward")
        if why:
            out.append(
                (
                    "train.grad_accum",
                    f"train.grad_accum={cfg.train.grad_accum}: not exact with the sharded head "
                    f"because {'; '.join(why)} (use grad_accum=1 or a larger batch)",
                )
            )
    if cfg.head.kernel == "triton" and importlib.util.find_spec("triton") is None:
        out.append(("head.kernel", "head.kernel='triton': triton is not installed "
                    "(pip install triton, or head.kernel=auto)"))
    if cfg.engine.type == "ddp" and cfg.engine.precision == "fp16":
        out.append(("engine.precision", "engine.precision='fp16': needs engine.type=deepspeed"))
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
    return out


def _backbone_errors(cfg: Config) -> list[tuple[str, str]]:
    """``partial_fc.backbones.backbone_errors`` on the section, each under the key it names."""
    from partial_fc.backbones import backbone_errors

    b = cfg.backbone
    out = []
    for msg in backbone_errors(**b.build_kwargs()):
        key = next((k for k in ("checkpointing", "depth") if msg.startswith(k)), "name")
        if key != "name":  # "depth=3: why" -> "why": the line names the key itself
            msg = msg.split(": ", 1)[-1]
        out.append((f"backbone.{key}", f"backbone.{key}={getattr(b, key)!r}: {msg}"))
    return out


def theory_warnings(cfg: Config) -> list[str]:
    """The theory checks (``partial_fc.margins.margin_warnings``) as one string each; empty
    while ``data.num_classes`` is unknown."""
    if cfg.data.num_classes is None:
        return []
    return margin_warnings(cfg.margin_kwargs(), cfg.data.num_classes, cfg.margin.p_w)


def _missing(package: str) -> bool:
    """Whether ``package`` cannot be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec(package) is None
    except ValueError:  # in sys.modules as None: import refused
        return True


def _sink_errors(cfg: Config) -> list[tuple[str, str]]:
    """The optional logging packages a run will import (``WANDB_MODE`` wins, as in training)."""
    out = []
    if cfg.log.tensorboard and _missing("tensorboard"):
        out.append(("log.tensorboard", "log.tensorboard=true: the tensorboard package is not "
                    "installed (pip install 'partial-fc[tensorboard]', or log.tensorboard=false)"))
    if (os.environ.get("WANDB_MODE") or cfg.log.wandb) != "disabled" and _missing("wandb"):
        out.append(("log.wandb", f"log.wandb={cfg.log.wandb!r}: the wandb package is not "
                    "installed (pip install 'partial-fc[wandb]', or log.wandb=disabled)"))
    return out


def resolve_errors(cfg: Config) -> list[tuple[str, str]]:
    """Checks against the data and the machine; fills ``data.num_classes/num_samples``."""
    out = _sink_errors(cfg) + _data_errors(cfg)
    out += _batch_errors(cfg) + _class_errors(cfg) + _batch_norm_errors(cfg)
    out += _output_errors(cfg)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        out.append(("device", "device='cuda': no CUDA device on this machine (the GPU "
                    "recipes set it; add device=cpu to train on the CPU instead)"))
    on_gpu = cfg.device in ("cuda", "auto") and torch.cuda.is_available()
    if cfg.engine.precision == "fp16" and not on_gpu:
        out.append(("engine.precision", "engine.precision='fp16': needs a CUDA device"))
    out += _gpu_errors(cfg) if on_gpu else []
    if cfg.engine.type == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        out.append(("engine.type", "engine.type='deepspeed': DeepSpeed is not installed "
                    "(pip install 'partial-fc[deepspeed]', or engine.type=ddp)"))
    weights = cfg.backbone.weights
    if weights is not None and not Path(weights).is_file():
        out.append(("backbone.weights", f"backbone.weights={weights!r}: no such file (a local "
                    "state_dict; nothing is downloaded)"))
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not Path(resume).is_dir():
        out.append(("checkpoint.resume", f"checkpoint.resume={resume!r}: no such folder (give "
                    "a run folder or one of its checkpoints/step-* folders, or auto / none)"))
    for i, b in enumerate(cfg.eval.bins):
        if not Path(b).is_file():
            from data_pipeline.verification_bin import MISSING_BIN_FIX

            out.append((f"eval.bins.{i}", f"eval.bins[{i}]={b!r}: no such file "
                        f"({MISSING_BIN_FIX})"))
    return out


def _data_errors(cfg: Config) -> list[tuple[str, str]]:
    """Fill ``data.num_classes/num_samples`` from the manifest (shards) or the synthetic
    settings, and report what contradicts them."""
    data, out = cfg.data, []
    if data.source == "synthetic":
        if data.num_classes is None:
            return [("data.num_classes", "data.num_classes: required with data.source="
                     "synthetic (the identities to generate, e.g. data.num_classes=1000000)")]
        if data.num_classes >= 1 << 31:
            out.append(("data.num_classes", f"data.num_classes={data.num_classes}: "
                        "data.source=synthetic generates fewer than 2^31 identities"))
        want = data.num_classes * data.synthetic_images_per_class
        if data.num_samples is None:
            data.num_samples = want
        elif data.num_samples != want:
            per_class = max(1, round(data.num_samples / data.num_classes))
            out.append(("data.num_samples", f"data.num_samples={data.num_samples}: data.source="
                        f"synthetic makes num_classes x synthetic_images_per_class = {want}; "
                        "a recipe's count: add data.num_samples=null (and e.g. "
                        f"data.synthetic_images_per_class={per_class})"))
        return out
    if "synthetic_images_per_class" in data.model_fields_set:
        out.append(("data.synthetic_images_per_class", "data.synthetic_images_per_class="
                    f"{data.synthetic_images_per_class}: only read with data.source=synthetic "
                    "(data.source='shards')"))
    data_dir = Path(data.dir)
    if not (data_dir / "manifest.json").is_file():
        return [*out, ("data.dir", f"data.dir={data.dir!r}: {_no_manifest(data_dir)}")]
    from data_pipeline import read_manifest
    from data_pipeline.errors import DataError

    try:
        man = read_manifest(data_dir)
    except DataError as err:  # a malformed manifest is one more line of the report
        return [*out, ("data.dir", f"data.dir={data.dir!r}: {err}")]
    for key in ("num_classes", "num_samples"):
        have, want = getattr(data, key), getattr(man, key)
        if have is None:
            setattr(data, key, want)
        elif have != want:
            out.append((f"data.{key}",
                        f"data.{key}={have}: manifest.json in {data_dir} says {want}"))
    return out


MAKE_DATA = ("convert a data set with `python -m launch.convert insightface SRC DIR` (or "
             "`imagefolder SRC DIR`), or `make train` for the synthetic set in data/synthetic")


def _no_manifest(data_dir: Path) -> str:
    """What is at ``data_dir`` instead of a converted data set, and what makes one. The
    manifest is written last (data_pipeline.writer), so shards without it are a conversion
    that did not finish."""
    if not data_dir.exists():
        import difflib

        parent = data_dir.parent if data_dir.parent.is_dir() else None
        sets = [p.name for p in parent.iterdir() if (p / "manifest.json").is_file()] if parent \
            else []
        near = difflib.get_close_matches(data_dir.name, sets, n=1)
        hint = f" (did you mean data.dir={str(data_dir.parent / near[0])!r}?)" if near else ""
        return f"no such folder{hint}; {MAKE_DATA}"
    shards = len(list(data_dir.glob("*.tar"))) if data_dir.is_dir() else 0
    if shards:
        return (f"no manifest.json there but {shards} shard(s): the conversion did not finish; "
                "run the same `python -m launch.convert` command again (it keeps finished "
                "shards)")
    return f"no manifest.json there (the folder holds no converted data set); {MAKE_DATA}"


def machine_notes(cfg: Config) -> list[str]:
    """The data and machine checks of ``load_config(..., resolve=True)`` as lines, for a
    config loaded with ``resolve=False`` (``--print-config`` before the data exists). Fills
    ``data.num_classes/num_samples`` where the manifest is there, so the theory checks run
    (their :class:`ConfigWarning` raised here, as ``load_config`` does)."""
    notes = [msg for _, msg in resolve_errors(cfg)]
    for msg in theory_warnings(cfg):
        warnings.warn(msg, ConfigWarning, stacklevel=2)
    return notes


def _launch_size(variable: str) -> int:
    """torchrun's ``WORLD_SIZE`` or ``LOCAL_WORLD_SIZE`` (1 without torchrun; ``launch.train
    --check`` sets them for the launch it checks), read at call time, before any group."""
    return int(os.environ.get(variable, "1"))


def _gpu_errors(cfg: Config) -> list[tuple[str, str]]:
    """What this node's GPUs cannot run: more ranks than GPUs (torchrun's LOCAL_WORLD_SIZE;
    two ranks cannot share one GPU under NCCL), bf16 without hardware support, several ranks
    without NCCL."""
    import torch.distributed as dist

    out = []
    gpus = torch.cuda.device_count()
    ranks = _launch_size("LOCAL_WORLD_SIZE")
    if ranks > gpus:
        out.append(("device", f"device={cfg.device!r}: {ranks} ranks on this node but {gpus} "
                    f"GPU(s) visible: launch --nproc_per_node {gpus} (make NPROC_PER_NODE="
                    f"{gpus}) or set device=cpu"))
    if cfg.engine.precision == "bf16" and gpus and not torch.cuda.is_bf16_supported():
        out.append(("engine.precision", "engine.precision='bf16': this GPU has no bf16 support "
                    "(before Ampere); use fp16 with engine.type=deepspeed, or fp32"))
    if _launch_size("WORLD_SIZE") > 1 and not dist.is_nccl_available():
        out.append(("device", f"device={cfg.device!r}: this torch build has no NCCL, which "
                    "multi-GPU runs need; install a CUDA build of torch with NCCL"))
    return out


def _batch_errors(cfg: Config) -> list[tuple[str, str]]:
    """A batch the data cannot fill on every rank (torchrun's WORLD_SIZE; 1 without it)."""
    from data_pipeline.epoch_plan import batches_per_rank

    n = cfg.data.num_samples
    world = _launch_size("WORLD_SIZE")
    batch, k = cfg.train.batch_size, cfg.train.grad_accum
    if n is None or batches_per_rank(n, world, batch) >= k:
        return []
    key = "train.batch_size" if batches_per_rank(n, world, batch) == 0 else "train.grad_accum"
    where = "the synthetic data" if cfg.data.source == "synthetic" else cfg.data.dir
    return [(key, f"train.batch_size={batch} x grad_accum={k} on {world} rank(s): the "
                  f"{n} samples in {where} cannot fill one step (at most "
                  f"{n // world} samples per rank)")]


def _class_errors(cfg: Config) -> list[tuple[str, str]]:
    """Every rank owns a contiguous block of at least one class (``PartialFC``), and a softmax
    over one class has nothing to tell apart (its loss is 0 whatever the backbone does)."""
    classes, world = cfg.data.num_classes, _launch_size("WORLD_SIZE")
    if classes is None:
        return []
    if classes < 2:
        return [("data.num_classes", f"data.num_classes={classes}: a margin softmax needs at "
                 "least 2 classes (with 1 the loss is 0 and nothing trains)")]
    if classes < world:
        return [("data.num_classes", f"data.num_classes={classes}: fewer classes than the "
                 f"{world} ranks, each of which holds a block of at least one class; launch "
                 f"at most {classes} ranks")]
    return []


def _batch_norm_errors(cfg: Config) -> list[tuple[str, str]]:
    """A micro-batch of one image cannot train a ``BatchNorm1d`` (the embedding layer of every
    face backbone here): torch refuses one value per channel in training mode."""
    if cfg.train.batch_size > 1:
        return []
    from torch import nn

    from partial_fc.backbones import build_backbone, list_backbones

    if cfg.backbone.name not in list_backbones():  # reported by semantic_errors
        return []
    with torch.device("meta"):
        model = build_backbone(**cfg.backbone.build_kwargs())
    if not any(isinstance(m, nn.BatchNorm1d) for m in model.modules()):
        return []
    return [("train.batch_size", f"train.batch_size=1: backbone.name={cfg.backbone.name!r} "
             "has BatchNorm1d, which cannot train on one image per rank; use a batch of 2 or "
             "more")]


def _output_errors(cfg: Config) -> list[tuple[str, str]]:
    """The run folder must be creatable and writable (checked before any process group)."""
    folder = cfg.run_dir.absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    key = "output" if cfg.output is not None else "name"
    if not existing.is_dir():
        return [(key, f"output={str(cfg.run_dir)!r}: {existing} is not a folder")]
    try:  # a real write: permission bits say nothing for root, read-only mounts or NFS
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return [(key, f"output={str(cfg.run_dir)!r}: cannot write in {existing} "
                      f"({exc.strerror})")]
    return []


# Keys whose change makes a checkpoint a different model (or an incompatible optimizer
# state): resuming across them is refused. Every other key may change, with a note.
# backbone.checkpointing may change (the same model and steps); backbone.depth may not.
MODEL_KEYS = ("backbone.name", "backbone.embedding_size", "backbone.dropout", "backbone.depth",
              "margin", "data.num_classes", "data.num_samples", "optim.name", "engine.type")
NOT_COMPARED = ("name", "output", "checkpoint.resume", "margin.p_w")


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


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
    old, new = _flatten(saved), _flatten(cfg.model_dump(mode="json"))
    changed = [
        f"{key} {old.get(key)!r} -> {new.get(key)!r}"
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

