"""The config checks against the data and the machine: :func:`resolve_config` fills
``data.num_classes/num_samples`` from the manifest (or the synthetic settings) and lists, as
(dotted key, message) pairs, what the data, the launch's ranks, CUDA and the optional packages
refuse. It runs before any process group starts, so a run fails in one report rather than on
one rank. Pure: the machine is a :class:`~trainer.config.machine.Machine` snapshot and the
manifest a value, both read at the edge (:meth:`Machine.observe`,
:mod:`trainer.config.on_disk`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from trainer.config.accumulation import micro_batches, world_size_error
from trainer.config.checks import schema_default
from trainer.config.head_memory import head_memory_errors
from trainer.config.machine import Machine
from trainer.config.schema import Config
from trainer.yaml_file import shown_value

if TYPE_CHECKING:
    from data_pipeline.manifest import Manifest


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
        if data.synthetic_images_per_class != schema_default(data, "synthetic_images_per_class"):
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
