"""Training configuration: the schema, YAML loading with ``base:`` inheritance, overrides.

The pydantic models below are the ONLY source of defaults; YAML files hold differences.
A recipe names its parent with ``base: base.yaml`` (resolved relative to the recipe's own
folder, chains allowed); mappings merge key by key, everything else (lists included)
replaces. Command-line overrides are ``dotted.key=value`` with the value parsed as YAML
(``margin.type=cosface optim.lr=0.05 eval.bins=[a.bin,b.bin]``).

Every problem found is reported at once, in one :class:`ConfigError`, one line each,
naming the file (or ``command line``) that set the key, the key, the value and the valid
choices. :func:`load_config` with ``resolve=True`` also reads the data's ``manifest.json``
and checks the machine (CUDA, files), so a run fails before any process group starts.
"""

from __future__ import annotations

import importlib.util
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from partial_fc.margins import AdaCosMode, MarginType, margin_errors, margin_warnings

CLI = "command line"

PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
UnitFloat = Annotated[float, Field(ge=0, lt=1)]
MAX_SCALE = 1024.0  # margin.s: the published recipes use 30-64


class ConfigError(ValueError):
    """A user error in a config: one line per problem, all problems together."""


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
        "(python -m launch.convert writes one); shards only"
    )
    num_classes: PosInt | None = Field(
        None, description="identities; shards: filled from manifest.json (if set, must match "
        "it); synthetic: required, the identities generated"
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


class BackboneConfig(_Section):
    name: str = Field(
        "iresnet50", description="backbone architecture (partial_fc.backbones.list_backbones())"
    )
    embedding_size: PosInt = Field(512, description="length of the face embedding")
    dropout: UnitFloat = Field(0.0, description="dropout before the embedding layer, in [0, 1)")


class MarginConfig(_Section):
    """Passed to ``partial_fc.build_margin`` minus ``p_w`` (a validation-only knob): one
    field per ``partial_fc.margins.MARGIN_KEYS``, whose rules (``margin_errors``) the
    config check calls."""

    type: MarginType = Field(
        "arcface", description="target-logit transform (partial_fc.margins): cos(m1*theta + m2)"
        " - m3 and its special cases, SphereFace's cos(m*theta), or AdaCos's adaptive scale"
    )
    # s*cos are the logits: past ~1e3 the softmax is a hard max and fp32 loses the margin.
    s: Annotated[float, Field(gt=0, le=MAX_SCALE)] = Field(
        64.0, description="fixed logit scale (ignored when margin.adacos is set)"
    )
    m: float = Field(
        0.5, description="the margin of sphereface (integer >= 1), cosface (>= 0, subtracted "
        "from the cosine) or arcface (radians in [0, pi), added to the angle)"
    )
    m1: PosFloat = Field(1.0, description="combined: multiplies the angle (SphereFace-like)")
    m2: float = Field(0.5, description="combined: radians added to the angle, in [0, pi)")
    m3: float = Field(0.0, description="combined: subtracted from the cosine, >= 0")
    adacos: AdaCosMode | None = Field(
        None, description="AdaCos scale (arXiv:1905.00292) instead of margin.s: fixed or "
        "dynamic; required for type=adacos, combinable with any type"
    )
    easy_margin: bool = Field(
        False, description="arcface/combined: apply the margin only where cos(theta) > 0"
    )
    lambda_base: NonNegFloat = Field(
        1000.0, description="sphereface annealing: the initial weight of the plain cosine; "
        "0 disables the annealing"
    )
    lambda_gamma: NonNegFloat = Field(
        0.12, description="sphereface annealing: lambda = lambda_base*(1 + gamma*step)^-power"
    )
    lambda_power: NonNegFloat = Field(1.0, description="sphereface annealing: decay exponent")
    lambda_min: NonNegFloat = Field(5.0, description="sphereface annealing: floor of lambda")
    p_w: Annotated[float, Field(gt=0, lt=1)] = Field(
        0.9, description="target-class probability the NormFace/CosFace bound on margin.s is "
        "checked against (a warning only; not passed to the margin)"
    )


class HeadConfig(_Section):
    sample_rate: Annotated[float, Field(gt=0, le=1)] = Field(
        1.0, description="share of the classes (the batch's own always included) each step's "
        "softmax is computed over (Partial FC); 1 = all"
    )
    kernel: Literal["auto", "torch", "triton"] = Field(
        "auto", description="class-tile passes of the head: triton (CUDA kernels), torch "
        "(chunked PyTorch), auto = triton on CUDA when installed, else torch"
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

    def partial_fc_kwargs(self) -> dict[str, Any]:
        """``PartialFC``'s keyword arguments this section sets (bytes, a torch dtype)."""
        return {"sample_rate": self.sample_rate, "kernel": self.kernel,
                "max_tile_bytes": self.max_tile_mib << 20,
                "state_dtype": {"fp32": torch.float32, "bf16": torch.bfloat16}[self.state_dtype]}


class OptimConfig(_Section):
    name: Literal["sgd", "adamw"] = Field("sgd", description="optimiser of backbone and head")
    lr: PosFloat = Field(0.1, description="peak learning rate (after warm-up)")
    momentum: UnitFloat = Field(0.9, description="sgd momentum")
    weight_decay: NonNegFloat = Field(5e-4, description="weight decay (decoupled for adamw)")
    betas: Annotated[list[UnitFloat], Field(min_length=2, max_length=2)] = Field(
        [0.9, 0.999], description="adamw: the two moment decay rates"
    )
    eps: PosFloat = Field(1e-8, description="adamw: denominator epsilon")


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
        1, description="micro-batches per optimisation step (exact only for a full-softmax, "
        "fixed-scale, non-SphereFace head)"
    )
    clip_grad_norm: PosFloat | None = Field(
        5.0, description="clip the backbone's gradient norm to this; null disables"
    )

    # A step with a non-finite loss or gradient is skipped on every rank (launch.engine);
    # this many in a row end the run with an error (the model is diverging).
    max_bad_steps: PosInt = Field(
        10, description="consecutive non-finite (skipped) steps after which the run stops"
    )


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
    cpu_shm_comm: bool = Field(
        False, description="deepspeed on CPU: use its shared-memory all-reduce (costs a ~30-50 "
        "s JIT build) instead of the gloo group"
    )
    channels_last: bool = Field(True, description="CUDA only (CPU ignores it): backbone and "
                                "input channels_last (H100 iresnet50 bf16: 1,977 -> 3,513 img/s)")
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
        "or checkpoints that take longer on one rank"
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
    every: PosInt = Field(2000, description="steps between evaluations of eval.bins")
    batch_size: PosInt = Field(256, description="images per evaluation batch")


class Config(_Section):
    name: str = Field("run", description="run name (W&B, logs, the default output folder)")
    output: str | None = Field(None, description="run folder; null = runs/<name>")
    seed: NonNegInt = Field(0, description="seed of initialisation, sampling and data order")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = cuda when available, else cpu"
    )
    data: DataConfig = _section(DataConfig, "the training data")
    backbone: BackboneConfig = _section(BackboneConfig, "the embedding network")
    margin: MarginConfig = _section(MarginConfig, "the margin-softmax loss")
    head: HeadConfig = _section(HeadConfig, "the class-sharded classifier (Partial FC)")
    optim: OptimConfig = _section(OptimConfig, "the optimiser")
    schedule: ScheduleConfig = _section(ScheduleConfig, "the learning-rate schedule")
    train: TrainConfig = _section(TrainConfig, "the training loop")
    engine: EngineConfig = _section(EngineConfig, "backbone replication and precision")
    checkpoint: CheckpointConfig = _section(CheckpointConfig, "saving and resuming")
    log: LogConfig = _section(LogConfig, "metrics, histograms and progress")
    eval: EvalConfig = _section(EvalConfig, "verification during training")
    dist: DistConfig = _section(DistConfig, "the process group")

    @property
    def run_dir(self) -> Path:
        return Path(self.output if self.output is not None else f"runs/{self.name}")

    def margin_kwargs(self) -> dict[str, Any]:
        """The dict for ``partial_fc.build_margin``."""
        return self.margin.model_dump(exclude={"p_w"})


# ----------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` as a float (YAML 1.1 wants ``1.0e-3``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    """A YAML mapping whose keys are unique: a repeated key is an error, not 'last one wins'."""
    loader.flatten_mapping(node)
    first: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in first:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first set at line {first[key] + 1})",
                key_node.start_mark)
        first[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def parse_value(text: str) -> Any:
    """Parse one override value the way YAML would (``0.1`` float, ``[a,b]`` list)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)  # noqa: S506 - SafeLoader
    except OSError as e:
        raise ConfigError(f"{_shown(path)}: cannot read config ({e.strerror})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{_shown(path)}: invalid YAML{where}: {what}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError(f"{_shown(path)}: top level must be a mapping, got {kind}")
    return data


def _merge(dst: dict, src: dict, source: str, origin: dict[str, str], prefix: str = "") -> None:
    """Deep-merge ``src`` into ``dst``, recording in ``origin`` where each key came from."""
    for key, value in src.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(dst.get(key, {}), dict):
            _merge(dst.setdefault(key, {}), value, source, origin, dotted + ".")
        else:
            dst[key] = value
            for k in [k for k in origin if k.startswith(dotted + ".")]:
                del origin[k]
            origin[dotted] = source


def _load_tree(path: Path, origin: dict[str, str], chain: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in chain:
        raise ConfigError(f"{_shown(chain[-1])}: base: cycle through {_shown(path)}")
    data = _read_yaml(path)
    tree: dict[str, Any] = {}
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{_shown(path)}: base={base!r}: must be a file name")
        base_path = path.parent / base
        if not base_path.is_file():
            raise ConfigError(f"{_shown(path)}: base={base!r}: no such file {_shown(base_path)}")
        tree = _load_tree(base_path, origin, (*chain, path))
    _merge(tree, data, _shown(path), origin)
    return tree


def _shown(path: Path) -> str:
    """``path`` relative to the working folder when it lies inside it (shorter messages)."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _apply_overrides(tree: dict, overrides: list[str], origin: dict[str, str]) -> list[str]:
    errors = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            errors.append(f"{CLI}: {item!r}: overrides are dotted.key=value")
            continue
        try:
            value = parse_value(text)
        except yaml.YAMLError:
            errors.append(f"{CLI}: {key}={text!r}: not a valid YAML value")
            continue
        nested: dict[str, Any] = value
        for part in reversed(key.split(".")):
            nested = {part: nested}
        _merge(tree, nested, CLI, origin)
    return errors


# ----------------------------------------------------------------------------- validation


def _source(origin: dict[str, str], dotted: str, default: str) -> str:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in origin:
            return origin[".".join(parts[:i])]
    return default


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Config
    for part in loc:
        field = model.model_fields.get(part) if model else None
        ann = field.annotation if field else None
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return model


def _schema_errors(err: ValidationError, origin: dict[str, str], top: str) -> list[str]:
    lines = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        dotted = ".".join(loc)
        src = _source(origin, dotted, top)
        if e["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            valid = ", ".join(parent.model_fields) if parent else "none"
            lines.append(f"{src}: {dotted}: unknown key (valid keys: {valid})")
        else:
            value = e.get("input")
            shown = "<missing>" if e["type"] == "missing" else repr(value)
            lines.append(f"{src}: {dotted}={shown}: {e['msg']}")
    return lines


def _semantic_errors(cfg: Config) -> list[tuple[str, str]]:
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
    try:
        from partial_fc.backbones import list_backbones
    except ImportError:  # backbones not installed: train.py fails later with a clear import error
        names = None
    else:
        names = list_backbones()
    if names is not None and cfg.backbone.name not in names:
        out.append(
            (
                "backbone.name",
                f"backbone.name={cfg.backbone.name!r}: unknown (valid: {', '.join(names)})",
            )
        )
    return out


def theory_warnings(cfg: Config) -> list[str]:
    """The theory checks (``partial_fc.margins.margin_warnings``) as one string each; empty
    while ``data.num_classes`` is unknown."""
    if cfg.data.num_classes is None:
        return []
    return margin_warnings(cfg.margin_kwargs(), cfg.data.num_classes, cfg.margin.p_w)


def _missing(package: str) -> bool:
    """Whether ``package`` cannot be imported (checked without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(package) is None
    except ValueError:  # in sys.modules as None: import refused
        return True


def _sink_errors(cfg: Config) -> list[tuple[str, str]]:
    """The optional logging packages a run will import (``WANDB_MODE`` wins, as in training)."""
    import os

    out = []
    if cfg.log.tensorboard and _missing("tensorboard"):
        out.append(("log.tensorboard", "log.tensorboard=true: the tensorboard package is not "
                    "installed (pip install 'partial-fc[tensorboard]', or log.tensorboard=false)"))
    if (os.environ.get("WANDB_MODE") or cfg.log.wandb) != "disabled" and _missing("wandb"):
        out.append(("log.wandb", f"log.wandb={cfg.log.wandb!r}: the wandb package is not "
                    "installed (pip install 'partial-fc[wandb]', or log.wandb=disabled)"))
    return out


def _resolve_errors(cfg: Config) -> list[tuple[str, str]]:
    """Checks against the data and the machine; fills ``data.num_classes/num_samples``."""
    import torch

    out = _sink_errors(cfg) + _data_errors(cfg)
    out += _batch_errors(cfg)
    out += _output_errors(cfg)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        out.append(("device", "device='cuda': no CUDA device on this machine"))
    on_gpu = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.engine.precision == "fp16" and not on_gpu:
        out.append(("engine.precision", "engine.precision='fp16': needs a CUDA device"))
    out += _gpu_errors(cfg) if on_gpu else []
    if cfg.engine.type == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        out.append(("engine.type", "engine.type='deepspeed': DeepSpeed is not installed "
                    "(pip install 'partial-fc[deepspeed]', or engine.type=ddp)"))
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not Path(resume).is_dir():
        out.append(("checkpoint.resume", f"checkpoint.resume={resume!r}: no such folder"))
    for i, b in enumerate(cfg.eval.bins):
        if not Path(b).is_file():
            out.append((f"eval.bins.{i}", f"eval.bins[{i}]={b!r}: no such file"))
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
            out.append(("data.num_samples", f"data.num_samples={data.num_samples}: data.source="
                        f"synthetic makes num_classes x synthetic_images_per_class = {want}"))
        return out
    if "synthetic_images_per_class" in data.model_fields_set:
        out.append(("data.synthetic_images_per_class", "data.synthetic_images_per_class="
                    f"{data.synthetic_images_per_class}: only read with data.source=synthetic "
                    "(data.source='shards')"))
    data_dir = Path(data.dir)
    if not (data_dir / "manifest.json").is_file():
        return [*out, ("data.dir", f"data.dir={data.dir!r}: no manifest.json there")]
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


def machine_notes(cfg: Config) -> list[str]:
    """The data and machine checks of ``load_config(..., resolve=True)`` as lines, for a
    config loaded with ``resolve=False`` (``--print-config`` before the data exists). Fills
    ``data.num_classes/num_samples`` where the manifest is there, so the theory checks run
    (their :class:`ConfigWarning` raised here, as ``load_config`` does)."""
    notes = [msg for _, msg in _resolve_errors(cfg)]
    for msg in theory_warnings(cfg):
        warnings.warn(msg, ConfigWarning, stacklevel=2)
    return notes


def _gpu_errors(cfg: Config) -> list[tuple[str, str]]:
    """What this node's GPUs cannot run: more ranks than GPUs (torchrun's LOCAL_WORLD_SIZE;
    two ranks cannot share one GPU under NCCL), bf16 without hardware support, several ranks
    without NCCL."""
    import torch
    import torch.distributed as dist

    out = []
    gpus = torch.cuda.device_count()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # read at call time, before any group
    if ranks > gpus:
        out.append(("device", f"device={cfg.device!r}: {ranks} ranks on this node but {gpus} "
                    f"GPU(s) visible: launch --nproc_per_node {gpus} (make NPROC_PER_NODE="
                    f"{gpus}) or set device=cpu"))
    if cfg.engine.precision == "bf16" and gpus and not torch.cuda.is_bf16_supported():
        out.append(("engine.precision", "engine.precision='bf16': this GPU has no bf16 support "
                    "(before Ampere); use fp16 with engine.type=deepspeed, or fp32"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_nccl_available():
        out.append(("device", f"device={cfg.device!r}: this torch build has no NCCL, which "
                    "multi-GPU runs need; install a CUDA build of torch with NCCL"))
    return out


def _batch_errors(cfg: Config) -> list[tuple[str, str]]:
    """A batch the data cannot fill on every rank (torchrun's WORLD_SIZE; 1 without it)."""
    from data_pipeline.plan import batches_per_rank

    n = cfg.data.num_samples
    world = int(os.environ.get("WORLD_SIZE", "1"))  # read at call time, before any group
    batch, k = cfg.train.batch_size, cfg.train.grad_accum
    if n is None or batches_per_rank(n, world, batch) >= k:
        return []
    key = "train.batch_size" if batches_per_rank(n, world, batch) == 0 else "train.grad_accum"
    where = "the synthetic data" if cfg.data.source == "synthetic" else cfg.data.dir
    return [(key, f"train.batch_size={batch} x grad_accum={k} on {world} rank(s): the "
                  f"{n} samples in {where} cannot fill one step (at most "
                  f"{n // world} samples per rank)")]


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


def load_config(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, resolve: bool = True
) -> Config:
    """Load ``path`` (with its ``base:`` chain), apply ``key=value`` overrides, validate.

    ``resolve=True`` (what ``launch.train`` does, before any process group) also reads
    ``data.dir/manifest.json`` to fill/check ``num_classes``/``num_samples`` (with
    ``data.source=synthetic``: no file; ``num_samples`` from the synthetic settings), checks the
    device, resume folder and eval files. Theory checks (known C) become :class:`ConfigWarning`.
    Raises :class:`ConfigError` listing every problem found.
    """
    origin: dict[str, str] = {}
    top = _shown(Path(path))
    tree = _load_tree(Path(path), origin)
    errors = _apply_overrides(tree, list(overrides), origin)
    broken: set[str] = set()
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:
        errors += _schema_errors(e, origin, top)
        # Keep checking what did validate: broken top-level keys fall back to defaults and
        # the checks below report nothing about them.
        broken = {str(err["loc"][0]) for err in e.errors() if err["loc"]}
        cfg = Config.model_validate({k: v for k, v in tree.items() if k not in broken})
    found = _semantic_errors(cfg)
    if resolve:
        found += _resolve_errors(cfg)
    errors += [
        f"{_source(origin, key, top)}: {msg}"
        for key, msg in found
        if key.split(".")[0] not in broken
    ]
    if errors:
        raise ConfigError("\n".join(errors))
    for msg in theory_warnings(cfg):
        warnings.warn(msg, ConfigWarning, stacklevel=2)
    return cfg


# Keys whose change makes a checkpoint a different model (or an incompatible optimizer
# state): resuming across them is refused. Every other key may change, with a note.
MODEL_KEYS = ("backbone.name", "backbone.embedding_size", "backbone.dropout", "margin",
              "data.num_classes", "data.num_samples", "optim.name", "engine.type")
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


def dump_config(cfg: Config) -> str:
    """The fully resolved config as YAML (what ``RUN/config.yaml`` holds; loadable again)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


# ----------------------------------------------------------------------------- key reference


def describe_keys(width: int = 92) -> str:
    """Every config key with its type, default and description, grouped by section: the
    reference ``python -m launch.train --help`` prints, generated from the schema."""
    lines: list[str] = []
    top = Config.model_fields
    for name, field in top.items():
        section = _section_model(field.annotation)
        if section is None:
            lines += _describe(name, field, width)
    for name, field in top.items():
        section = _section_model(field.annotation)
        if section is not None:
            lines += ["", f"{name}: {field.description}"]
            for key, sub in section.model_fields.items():
                lines += _describe(f"{name}.{key}", sub, width)
    return "\n".join(lines)


def _section_model(annotation: Any) -> type[_Section] | None:
    """The section model a top-level key holds, or None for a plain key (name, seed, ...)."""
    return annotation if isinstance(annotation, type) and issubclass(annotation, _Section) else None


def _describe(key: str, field: Any, width: int) -> list[str]:
    import textwrap

    kind = _type_name(field.annotation) + _bounds(field.metadata)
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
                    parts.append(f"{symbol} {getattr(bound, attr)}")
            if getattr(bound, "min_length", None) is not None:  # betas: min == max
                parts.append(f"length {bound.min_length}")
    return f" ({', '.join(parts)})" if parts else ""
