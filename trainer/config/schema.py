"""The config schema: every key, its type, bounds, default and description, in one place.

The pydantic models below are the ONLY source of defaults; YAML files hold differences
(:mod:`trainer.config.files` reads them). The ``margin:`` section is one model per
``margin.type``, generated from ``partial_fc.margins``' registry, and ranges partial_fc states
(``head.sample_rate``, the margin keys') are checked by its rules, in its words. The schema
alone refuses unknown keys, a margin key of another type, wrong types and out-of-range values;
what needs several keys, the data or the machine is checked in :mod:`trainer.config.checks`.
:func:`describe_keys` turns the schema into the key reference ``python -m launch.train --help``
prints, so that reference cannot drift from the defaults.
"""

from __future__ import annotations

import math
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, create_model

from data_pipeline.codec import MAX_PIXELS
from partial_fc.head_checks import SAMPLE_RATE
from partial_fc.margins.keys import Bounds
from partial_fc.margins.registry import (
    DEFAULT_TYPE,
    MARGIN_TYPES,
    SchemaKey,
    own_keys,
    schema_keys,
)
from partial_fc.tiles import KERNELS
from trainer.errors import Refused

PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
UnitFloat = Annotated[float, Field(ge=0, lt=1)]


class ConfigError(Refused, ValueError):
    """A user error in a config: one line per problem, all problems together (exit 2)."""

    label = "config error"


class ConfigWarning(UserWarning):
    """A config that runs but contradicts the theory (e.g. a scale too small to converge)."""


class _Section(BaseModel):
    # allow_inf_nan=False: a float key given as .inf/.nan (or 1e400) is refused, not trained on.
    model_config = ConfigDict(
        extra="forbid", strict=True, validate_default=True, allow_inf_nan=False
    )


def _section(model: type[_Section], description: str) -> Any:
    """A top-level key holding a whole section (its default: the section's defaults)."""
    return Field(default_factory=model, description=description)


class DataConfig(_Section):
    source: Literal["shards", "synthetic"] = Field(
        "shards", description="shards: the webdataset folder data.dir; synthetic: learnable "
        "synthetic images generated in batches on the training device "
        "(data_pipeline.synthetic_stream; no folder, data.num_classes required)"
    )
    dir: str = Field(
        "data/synthetic", description="folder of webdataset shards and their manifest.json "
        "(python -m launch.convert writes one), or its URL (s3://, gs://, https://, file://: "
        "streamed, docs/data.md); shards only"
    )
    dirs: list[str] | None = Field(
        None, description="several shard folders trained together instead of data.dir: every "
        "batch mixes them by data.weights, each read once per its own epoch, its labels "
        "offset into one class space (data_pipeline.mixture)"
    )
    weights: list[PosFloat] | None = Field(
        None, description="data.dirs only: each folder's share of every batch; null = their "
        "sample counts"
    )
    exclude: str | list[str | None] | None = Field(
        None, description="an exclusion list (`sample KEY` / `class LABEL` lines, as python -m "
        "launch.overlap writes) left out of training; with data.dirs a list parallel to it "
        "(null: none), each in its folder's own labels"
    )
    merge: str | None = Field(
        None, description="data.dirs only: a merge list (`pair I:CLASS J:CLASS` lines, as "
        "python -m launch.overlap --between writes; `-` strikes a line) whose paired classes "
        "train as one: one class per person (data_pipeline.merge)"
    )
    merge_digest: str | None = Field(
        None, description="filled from data.merge: a digest of its folders and pairs as read "
        "(not its comments or struck lines); a resume with another list is refused"
    )
    num_classes: PosInt | None = Field(
        None, description="identities; shards: filled from manifest.json (data.dirs: their "
        "sum, less the classes data.merge joins; if set, must match); synthetic: required, "
        "the identities generated"
    )
    num_samples: PosInt | None = Field(
        None, description="images per epoch; filled from manifest.json or, synthetic, as "
        "num_classes x synthetic_images_per_class (if set, must match)"
    )
    synthetic_images_per_class: PosInt = Field(
        4, description="synthetic only: images per identity, each a pure function of (seed, "
        "identity, image)"
    )
    num_workers: NonNegInt = Field(
        2, description="loader worker processes per rank decoding shards; 0 = in the main "
        "process (synthetic: unused, batches are generated on the device)"
    )
    flip: bool = Field(True, description="random horizontal flip of training images")
    max_pixels: Annotated[int, Field(ge=112 * 112, le=10**9)] = Field(
        MAX_PIXELS, description="shards: a sample whose image header claims more pixels "
        "(width x height) is skipped and counted before it is decoded (docs/readers.md); at "
        "least the loader's 112 x 112, at most 10^9 (3 GB decoded)"
    )
    cache_dir: str | None = Field(
        None, description="data at a URL: a node-local folder keeping whole shards once fetched "
        "(shared by the node's ranks and workers; later epochs read it); null = stream only"
    )
    cache_gib: PosFloat = Field(100.0, description="data.cache_dir's bound in GiB (least "
                                "recently read shards evicted)")

    def folders(self) -> list[str]:
        """The shard folders read: ``dirs``, else ``[dir]``."""
        return list(self.dirs) if self.dirs is not None else [self.dir]

    def exclusions(self) -> list[str | None]:
        """One exclusion list (or None) per folder of :meth:`folders`."""
        if isinstance(self.exclude, list):
            return list(self.exclude)
        return [self.exclude] * len(self.folders())


class BackboneConfig(_Section):
    name: str = Field(
        "iresnet50", description="backbone architecture (partial_fc.backbones.list_backbones():"
        " iresnet*, mobilefacenet, mbf, mbf_large, vit_t|s|b|l|h), or timm:<model> for a timm "
        "model (pip install 'partial-fc[timm]')"
    )
    embedding_size: PosInt = Field(512, description="length of the face embedding")
    dropout: UnitFloat = Field(0.0, description="dropout before the embedding layer, in [0, 1)")
    checkpointing: NonNegInt = Field(0, description="activation checkpointing (iresnet*, "
                                     "vit_*): 0 = off, k = every k-th block recomputed in the "
                                     "backward; exact (docs/vit.md)")
    depth: PosInt | None = Field(None, description="vit_* only: transformer blocks instead "
                                 "of the architecture's (small CPU runs); null = its own")
    drop_path: Annotated[float, Field(ge=0, lt=1)] | None = Field(
        None, description="vit_* only: the last block's stochastic-depth rate; null = the "
        "architecture's own (arcface_torch's plain vit_t|s|b: 0.1)")
    mask_ratio: Annotated[float, Field(ge=0, lt=1)] | None = Field(
        None, description="vit_* only: the share of tokens masked in training; null = the "
        "architecture's own (arcface_torch's plain vit_t|s|b: 0.1)")
    weights: str | None = Field(None, description="a local state_dict to start from (the "
                                "backbone's; for timm:<model> the timm model's); null = random")

    def build_kwargs(self) -> dict[str, Any]:
        """``partial_fc.backbones.build_backbone``'s arguments this section sets."""
        return {"name": self.name, "embedding_size": self.embedding_size,
                "dropout": self.dropout, "checkpointing": self.checkpointing,
                "depth": self.depth, "drop_path": self.drop_path, "mask_ratio": self.mask_ratio}


def _bounded(kind: Any, bounds: Bounds, need: str = "must be") -> Any:
    """``kind`` held to ``bounds``, a range partial_fc declares with its rule: the value gets
    that rule's message (``need``: its first words), ``--help`` shows the range."""
    def check(value: Any) -> Any:
        broken = None if value is None else bounds.rule(value, need)
        if broken:
            raise ValueError(broken)
        return value

    return Annotated[kind, bounds, AfterValidator(check)]


def _margin_field(key: SchemaKey, kind: str) -> tuple[Any, Any]:
    """A ``margin:`` field of type ``kind`` from the registry's key, its bounds checked with
    the registry's message (``kind needs ...`` for the type's own keys)."""
    ann, b = key.annotation, key.bounds
    if b is not None and b != Bounds():
        need = f"{kind} needs" if key.name in own_keys(kind) else "must be"
        ann = _bounded(ann, b, need)
    return ann, Field(key.default, description=key.description)


P_W = (Annotated[float, Field(gt=0, lt=1)], Field(
    0.9, description="target-class probability the NormFace/CosFace bound on margin.s is "
    "checked against (a warning only; not passed to the margin)"))


def _margin_model(kind: str) -> type[_Section]:
    """The ``margin:`` section of ``margin.type=kind``, generated from its registry entry (the
    shared keys and the type's own: defaults, bounds, descriptions), plus ``p_w``."""
    return create_model(
        f"MarginConfig[{kind}]", __base__=_Section, __doc__="Passed to "
        f"``partial_fc.build_margin`` minus ``p_w``; generated from ``REGISTRY[{kind!r}]``.",
        **{key.name: _margin_field(key, kind) for key in schema_keys(kind)}, p_w=P_W)


MARGIN_MODELS: dict[str, type[_Section]] = {kind: _margin_model(kind) for kind in MARGIN_TYPES}


def _margin_tag(value: Any) -> Any:
    """The model a ``margin:`` value is validated by: its ``type`` (absent: the default type;
    not a mapping: the default type's model, which refuses it)."""
    if isinstance(value, BaseModel):
        return value.type
    tag = value.get("type", DEFAULT_TYPE) if isinstance(value, dict) else DEFAULT_TYPE
    return tag if isinstance(tag, str) else repr(tag)


# The margin section: one model per margin.type, chosen by the section's own type key, so that
# a key of another type is refused (trainer.config.files names the type that reads it). The
# rules that tie keys together (partial_fc.margins.registry.margin_errors) are reported by the
# config check.
MarginConfig = Annotated[
    typing.Union[tuple(Annotated[model, Tag(kind)]  # noqa: UP007 - built from a tuple
                       for kind, model in MARGIN_MODELS.items())],
    Discriminator(_margin_tag),
]


class LossConfig(_Section):
    """ArcFace's auxiliary losses (arXiv:1801.07698 Eq. 5-7), added to the margin softmax with
    these weights (``partial_fc.aux_losses``)."""

    intra: NonNegFloat = Field(0.0, description="weight of Intra-Loss, the mean target angle / "
                               "pi; 0 = off")
    inter: NonNegFloat = Field(0.0, description="weight of Inter-Loss, minus the mean angle "
                               "between target centres and all other centres / pi; 0 = off")
    triplet: NonNegFloat = Field(0.0, description="weight of the angular Triplet-Loss "
                                 "(batch-hard over the global batch); 0 = off")
    triplet_margin: NonNegFloat = Field(0.35, description="Triplet-Loss margin (radians)")


class HeadConfig(_Section):
    sample_rate: _bounded(float, SAMPLE_RATE) = Field(  # type: ignore[valid-type]
        1.0, description="share of the classes (the batch's own always included) each step's "
        "softmax is computed over (Partial FC); 1 = all, 0 = the batch's own only"
    )
    kernel: Literal[KERNELS] = Field(
        "auto", description="class-tile passes of the head: triton (CUDA kernels), torch "
        "(PyTorch, chunked over classes), auto = triton on CUDA when installed, else torch; the "
        "first step checks the kernels against torch on a slice: auto goes on with torch after "
        "a mismatch (one line says so), triton stops the run"
    )
    max_tile_mib: PosInt = Field(
        32, description="torch kernel: MiB of fp32 [batch, classes] cosines per class chunk "
        "(memory budget; no [batch, num_local] buffer is ever allocated)"
    )
    # Its own budget, not max_tile_mib: it bounds other tensors ([rows, D] copies, whatever the
    # batch), on every kernel, and trades memory against kernel launches per step.
    max_update_mib: PosInt = Field(
        64, description="head optimizer: MiB of fp32 temporaries per chunk of updated rows "
        "(bounds the step's working memory whatever the number of sampled rows)"
    )
    state_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="dtype of the head's weight, gradient and optimizer state; bf16 "
        "halves them (bf16 matmul operands, fp32 accumulation, softmax and update arithmetic)"
    )
    update: Literal["sampled", "dense"] = Field(
        "sampled", description="head optimizer at sample_rate < 1: sampled = only the rows "
        "of the step's sample move; dense = every row, unsampled ones by momentum and weight "
        "decay (insightface arcface_torch's single SGD over the shard)"
    )
    init: Literal["per_class", "per_rank"] = Field(
        "per_class", description="initial rows: per_class = a function of (seed, class), "
        "the same on any number of ranks; per_rank = every rank starts from rank 0's rows "
        "(arcface_torch: one seed, the same draw on every rank)"
    )
    loss_cap: PosFloat | None = Field(
        None, description="report each sample's loss as at most this (arcface_torch: "
        "-ln 1e-30 = 69.08); the gradient is not changed, as there; null = no cap"
    )
    grad_filter: bool = Field(
        False, description="triton kernel: skip the backward's class tiles whose gradient "
        "sits below the bf16 rounding it already gets (bounded; docs/kernels.md); off = exact, "
        "until a GPU run shows an unchanged training curve; torch path and non-target "
        "transforms stay exact"
    )

    def partial_fc_kwargs(self) -> dict[str, Any]:
        """``PartialFC``'s keyword arguments this section sets (bytes, a torch dtype)."""
        return {"sample_rate": self.sample_rate, "kernel": self.kernel,
                "init": self.init, "loss_cap": self.loss_cap, "grad_filter": self.grad_filter,
                "max_tile_bytes": self.max_tile_mib << 20,
                "state_dtype": {"fp32": torch.float32, "bf16": torch.bfloat16}[self.state_dtype]}


class OptimConfig(_Section):
    name: Literal["sgd", "adamw"] = Field(
        "sgd", description="optimiser of backbone (torch's SGD / AdamW, decoupled decay) and "
        "head (its row-sampling twin: partial_fc.optim)"
    )
    lr: PosFloat = Field(0.1, description="peak learning rate (after warm-up)")
    momentum: UnitFloat = Field(0.9, description="sgd momentum")
    weight_decay: NonNegFloat = Field(5e-4, description="weight decay (decoupled for adamw)")
    betas: Annotated[list[UnitFloat], Field(min_length=2, max_length=2)] = Field(
        [0.9, 0.999], description="adamw: the two moment decay rates"
    )
    eps: PosFloat = Field(1e-8, description="adamw: denominator epsilon")
    decay: Literal["all", "weights"] = Field(
        "all", description="backbone weight decay on all parameters, or on weights only: not "
        "norms, biases, PReLU slopes, position embeddings (the ViT setting); head: always"
    )


class ScheduleConfig(_Section):
    type: Literal["poly", "cosine"] = Field(
        "poly", description="learning-rate decay after warm-up, to 0 at the last step"
    )
    warmup_epochs: NonNegFloat = Field(
        0.0, description="epochs of linear warm-up from 0 to optim.lr"
    )
    power: PosFloat = Field(2.0, description="poly only: lr * (1 - t/T)^power")


class TrainConfig(_Section):
    batch_size: PosInt = Field(128, description="images per rank per micro-batch")
    epochs: PosInt = Field(20, description="passes over the data")
    max_steps: PosInt | None = Field(
        None, description="stop (and end the LR schedule) after this many steps; null = epochs"
    )
    grad_accum: PosInt = Field(
        1, description="micro-batches per rank per optimisation step (exact only for a "
        "full-softmax, fixed-scale, non-SphereFace head); not with train.global_batch"
    )
    global_batch: PosInt | None = Field(
        None, description="images per optimisation step, all ranks together: train.batch_size "
        "is then the micro-batch and each of P ranks runs global_batch / (batch_size x P) of "
        "them, derived at every start and resume; null = batch_size x grad_accum x P"
    )
    clip_grad_norm: PosFloat | None = Field(
        5.0, description="clip the backbone's gradient norm to this; null disables"
    )

    # A step with a non-finite loss or gradient is skipped on every rank (trainer.engine);
    # this many in a row end the run with an error (the model is diverging).
    max_bad_steps: PosInt = Field(
        10, description="consecutive non-finite (skipped) steps after which the run stops"
    )


ZeroSetting = Literal["overlap_comm", "contiguous_gradients", "reduce_bucket_size",
                     "allgather_bucket_size"]
"""The keys of DeepSpeed's ``zero_optimization`` section ``engine.zero_settings`` may set."""


class EngineConfig(_Section):
    type: Literal["ddp", "deepspeed"] = Field(
        "ddp", description="how the backbone is replicated: torch DDP or DeepSpeed ZeRO (the "
        "head is always sharded by class)"
    )
    zero_stage: Literal[0, 1, 2] = Field(1, description="deepspeed only: ZeRO stage")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="backbone compute precision (margins and softmax stay fp32); fp16 "
        "needs deepspeed and a GPU"
    )
    broadcast_buffers: bool = Field(
        True, description="ddp: copy rank 0's buffers (BatchNorm statistics) to every rank "
        "before each forward; false keeps each rank's own (arcface_torch), averaged at saves"
    )
    grad_compression: Literal["none", "fp16"] = Field(
        "none", description="ddp: all-reduce the backbone's gradients in fp16 (torch's "
        "fp16_compress_hook, as arcface_torch registers it): half the traffic, fp16 rounding"
    )
    cpu_shm_comm: bool = Field(
        False, description="deepspeed on CPU: use its shared-memory all-reduce (costs a ~30-50 "
        "s JIT build) instead of the gloo group"
    )
    channels_last: bool = Field(True, description="CUDA only (CPU ignores it): backbone and "
                                "input channels_last, the layout tensor-core convolutions read "
                                "(the speed-up: docs/benchmarks.md)")
    cudnn_benchmark: bool = Field(
        True, description="CUDA only: cuDNN times its convolution algorithms on the first "
        "step (inputs are a fixed size); the chosen algorithms, so the last bits, may differ "
        "between invocations"
    )
    compile: bool = Field(
        False, description="torch.compile (inductor) the backbone that trains, inside DDP or "
        "DeepSpeed; evaluation and checkpoints use the plain module. Costs compile time at the "
        "first steps (again at each new input shape) and needs a C++ compiler on CPU"
    )
    one_rank_ddp: bool = Field(
        False, description="ddp on one rank: wrap the backbone in DistributedDataParallel "
        "anyway; false trains it unwrapped there (the same gradients and checkpoints, without "
        "DDP's hooks and buckets); true only to measure them"
    )
    prefetch: bool = Field(
        True, description="CUDA only: each batch's copy to the GPU queued on a side stream, "
        "from pinned memory, as the loader hands it over, ahead of its step; false copies it "
        "on the step's own stream"
    )
    fused_updates: bool = Field(
        True, description="the head's SGD step over every row (dense fp32 gradient: r = 1) in "
        "torch's fused kernel, and on CUDA the backbone's gradient norm in foreach kernels; "
        "false: the chunked update and per-tensor norms (to measure them)"
    )
    zero_settings: dict[ZeroSetting, NonNegInt] = Field(
        {}, description="deepspeed only: values put into its zero_optimization section "
        "(overlap_comm, contiguous_gradients: 0/1; reduce_bucket_size, allgather_bucket_size: "
        "elements); unset ones keep DeepSpeed's defaults"
    )


class CheckpointConfig(_Section):
    every: NonNegInt = Field(2000, description="steps between checkpoints; 0 = only at the end")
    keep: PosInt = Field(3, description="newest checkpoints kept in RUN/checkpoints")
    resume: str = Field(
        "auto", description="auto (RUN/checkpoints/latest if any), none, or a checkpoint or "
        "run folder to resume from"
    )


class DistConfig(_Section):
    timeout_s: PosFloat = Field(
        300.0, description="seconds a collective may wait for the other ranks before the run "
        "ends with a message naming the step (a stopped or hung rank); raise it for evaluation "
        "or checkpoints that take longer on one rank. A rank outlives a dead launcher by at "
        "most this + 20 s"
    )


class LogConfig(_Section):
    every: PosInt = Field(10, description="steps between metric lines (RUN/metrics.jsonl, W&B)")
    hist_every: NonNegInt = Field(
        500, description="steps between target/non-target angle histograms (RUN/histograms.jsonl,"
        " W&B, TensorBoard); 0 = none, and no collective samples them"
    )
    wandb: Literal["offline", "online", "disabled"] = Field(
        "offline", description="Weights & Biases mode (the WANDB_MODE variable overrides it); "
        "offline writes RUN/wandb for a later wandb sync"
    )
    wandb_project: str = Field("partial-fc", description="W&B project name")
    progress: bool = Field(
        True, description="a progress bar when stderr is a terminal; otherwise (and with false) "
        "one plain line every log.every steps"
    )
    tensorboard: bool = Field(
        False, description="also write scalars and histograms to RUN/tb (needs the tensorboard "
        "package: pip install 'partial-fc[tensorboard]')"
    )


class EvalConfig(_Section):
    bins: list[str] = Field(
        [], description="verification .bin files (LFW, CFP-FP, ...) evaluated during training "
        "and at the end"
    )
    rfw: str | None = Field(
        None, description="RFW folder of one .bin per group (<group>_test.bin or <group>.bin): "
        "accuracy per group and their spread (TFace's rule), with eval.bins"
    )
    every: PosInt = Field(2000, description="steps between evaluations of eval.bins and eval.rfw")
    batch_size: PosInt = Field(256, description="images per evaluation batch")


class DistillConfig(_Section):
    """Embedding distillation from a frozen teacher (partial_fc.distill), added to the
    margin loss: ``loss = margin loss + weight * distillation loss``."""

    embeddings: str | None = Field(
        None, description="offline teacher: the folder python -m launch.embed wrote for "
        "data.dir (read by sample key; no teacher forward during training)"
    )
    teacher: str | None = Field(
        None, description="online teacher: a run folder, checkpoint or .onnx file, run on "
        "every batch (a second forward pass per step; small sets)"
    )
    loss: Literal["cosine", "l2", "similarity"] = Field(
        "cosine", description="cosine: 1 - cos(student, teacher); l2: squared distance of the "
        "raw embeddings; similarity: the global batch's cosine-similarity matrices compared "
        "(relational, any teacher width)"
    )
    weight: NonNegFloat = Field(1.0, description="the distillation loss's factor")
    head_init: bool = Field(
        False, description="distill.embeddings only: start each class centre (head row) in "
        "the direction of the mean of its samples' teacher embeddings, a shared embedding "
        "space (fresh runs; needs the teacher's width)"
    )

    @property
    def enabled(self) -> bool:
        return self.embeddings is not None or self.teacher is not None


class Config(_Section):
    name: str = Field("run", description="run name (W&B, logs, the default output folder)")
    output: str | None = Field(None, description="run folder; null = runs/<name>; a URL "
                               "(s3://, gs://, az://) keeps the run in that object store")
    output_lock: bool = Field(True, description="one job per run folder (a lease object where "
                              "output is a URL); false only where the store ignores "
                              "conditional writes (an emulator) and you make sure of it")
    seed: NonNegInt = Field(0, description="seed of initialisation, sampling and data order")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = cuda when available, else cpu"
    )
    data: DataConfig = _section(DataConfig, "the training data")
    backbone: BackboneConfig = _section(BackboneConfig, "the embedding network")
    margin: MarginConfig = _section(MARGIN_MODELS[DEFAULT_TYPE], "the margin-softmax loss; "
                                    "margin.type picks which keys are read")
    loss: LossConfig = _section(LossConfig, "auxiliary loss terms")
    head: HeadConfig = _section(HeadConfig, "the class-sharded classifier (Partial FC)")
    optim: OptimConfig = _section(OptimConfig, "the optimiser")
    schedule: ScheduleConfig = _section(ScheduleConfig, "the learning-rate schedule")
    train: TrainConfig = _section(TrainConfig, "the training loop")
    engine: EngineConfig = _section(EngineConfig, "backbone replication and precision")
    checkpoint: CheckpointConfig = _section(CheckpointConfig, "saving and resuming")
    log: LogConfig = _section(LogConfig, "metrics, histograms and progress")
    eval: EvalConfig = _section(EvalConfig, "verification during training")
    dist: DistConfig = _section(DistConfig, "the process group")
    distill: DistillConfig = _section(DistillConfig, "distillation from a teacher's embeddings")

    @property
    def run_location(self) -> str:
        """The run folder as given: a path or a URL."""
        return self.output if self.output is not None else f"runs/{self.name}"

    @property
    def run_dir(self) -> Path:
        """The run folder on this machine: for a store URL, this node's copy of it
        (``data_pipeline.store.local_path``), which the run mirrors to the store."""
        from data_pipeline.store import local_path

        return local_path(self.run_location)

    def shown(self, path: Path | str) -> str:
        """``path`` (in :attr:`run_dir`) as the user named the run folder: under its URL for a
        folder in a store, as it is otherwise."""
        return str(path).replace(str(self.run_dir), self.run_location.rstrip("/"), 1)

    def partial_fc_kwargs(self) -> dict[str, Any]:
        """``PartialFC``'s keyword arguments: the head section's, and the margin's
        sub-centers (the weight's shape)."""
        return {**self.head.partial_fc_kwargs(), "subcenters": self.margin.subcenters}

    def margin_kwargs(self) -> dict[str, Any]:
        """The dict for ``partial_fc.build_margin``."""
        return self.margin.model_dump(exclude={"p_w"})


def dump_config(cfg: Config) -> str:
    """The fully resolved config as YAML (what ``RUN/config.yaml`` holds; loadable again)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


# ----------------------------------------------------------------------------- key reference


def describe_keys(width: int = 92) -> str:
    """Every config key with its type, default and description, grouped by section (the
    margin's: the keys every type reads, then each type's own): the reference
    ``python -m launch.train --help`` prints, generated from the schema."""
    lines: list[str] = []
    top = Config.model_fields
    for name, field in top.items():
        if _section_model(field.annotation) is None and not tagged_sections(field.annotation):
            lines += _describe(name, field, width)
    for name, field in top.items():
        section = _section_model(field.annotation)
        if section is not None:
            lines += ["", f"{name}: {field.description}"]
            for key, sub in section.model_fields.items():
                lines += _describe(f"{name}.{key}", sub, width)
        elif members := tagged_sections(field.annotation):
            lines += ["", f"{name}: {field.description}", *_describe_union(name, field, members,
                                                                           width)]
    return "\n".join(lines)


def _describe_union(name: str, field: Any, members: dict[str, type[_Section]],
                    width: int) -> list[str]:
    """A section whose ``type`` key picks its model (``margin``): the choices, the keys every
    model holds, then each model's own under ``name.type=TAG:``."""
    first = type(field.get_default(call_default_factory=True)).model_fields
    common = [k for k in first
              if k != "type" and all(k in m.model_fields for m in members.values())]
    lines = _describe(f"{name}.type", first["type"], width, Literal[tuple(members)])
    for key in common:
        lines += _describe(f"{name}.{key}", first[key], width)
    for kind, model in members.items():
        own = [k for k in model.model_fields if k != "type" and k not in common]
        lines.append(f"  {name}.type={kind}:" + ("" if own else " no keys of its own"))
        for key in own:
            lines += ["  " + line for line in _describe(f"{name}.{key}", model.model_fields[key],
                                                         width - 2)]
    return lines


def _section_model(annotation: Any) -> type[_Section] | None:
    """The section model a top-level key holds, or None for a plain key (name, seed, ...)."""
    return annotation if isinstance(annotation, type) and issubclass(annotation, _Section) else None


def tagged_sections(annotation: Any) -> dict[str, type[_Section]]:
    """The models of a section that is a union discriminated by a tag (``margin``), by tag;
    empty for any other annotation."""
    out = {}
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is Annotated:
            model, *meta = typing.get_args(arg)
            tags = [m.tag for m in meta if isinstance(m, Tag)]
            if tags and _section_model(model):
                out[tags[0]] = model
    return out


def _describe(key: str, field: Any, width: int, annotation: Any = None) -> list[str]:
    """``key``'s line (type, bounds, default) and its description; ``annotation``: shown
    instead of the field's."""
    import textwrap

    kind = _type_name(annotation or field.annotation) + _bounds(field.metadata)
    head = f"  {key}: {kind} = {_yaml_value(field.get_default(call_default_factory=True))}"
    return [head, *textwrap.wrap(field.description, width, initial_indent=" " * 6,
                                 subsequent_indent=" " * 6)]


def _yaml_value(value: Any) -> str:
    """``value`` as it would be written in a recipe (``null``, ``true``, ``[0.9, 0.999]``)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1000)
    return text.removesuffix("\n...\n").strip()


def _type_name(annotation: Any) -> str:
    import types
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0]) + _bounds(args[1:])
    if origin is Literal:
        return "|".join(_yaml_value(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        named = [_type_name(a) for a in args if a is not type(None)]
        return " | ".join(named) + (" | null" if type(None) in args else "")
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(metadata: Any) -> str:
    """``gt=0`` as `` > 0`` and so on (constraints sit in FieldInfo.metadata or directly)."""
    symbols = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    parts = []
    for item in metadata:
        for bound in getattr(item, "metadata", [item]):
            for attr, symbol in symbols.items():
                if getattr(bound, attr, None) is not None:
                    value = getattr(bound, attr)
                    parts.append(f"{symbol} {'pi' if value == math.pi else value}")
            if getattr(bound, "min_length", None) is not None:  # betas: min == max
                parts.append(f"length {bound.min_length}")
    return f" ({', '.join(parts)})" if parts else ""
