"""Does a run fit, and what does each step move: the planner behind ``launch.plan``.

Per-GPU memory of the sharded head and of the backbone, the bytes and time of every
collective of one step and the largest class count that fits, all from
``partial_fc.memory`` (the formulas, with their derivation).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from partial_fc import memory
from partial_fc.backbones import build_backbone, vit
from trainer.errors import Refused
from trainer.measured_figures import figures

GIB = 2**30

class PlanError(Refused, ValueError):
    """An impossible input: one line naming the flag and the value."""


@dataclass(frozen=True)
class Inputs:
    classes: int
    gpus: int
    gpus_per_node: int
    sample_rate: float
    dim: int
    batch: int
    backbone: str
    state_dtype: str
    gpu_memory: float
    optimizer: str
    precision: str
    engine: str
    zero_stage: int
    max_tile_mib: int
    max_update_mib: int
    reserve: float
    intra_bw: float
    inter_bw: float
    latency_us: float
    row_sparse_grad: bool
    checkpointing: int = 0
    subcenters: int = 1
    global_batch: int | None = None  # train.global_batch: images per step (batch: the micro)
    statistics_pass: bool = False  # the head's statistics move (trainer.engine.step_statistics)


@functools.cache
def backbone_params(name: str, dim: int) -> tuple[int, int]:
    """``(parameters, trainable parameters)``, from building the model on the meta device
    (no weights allocated; still seconds for the largest: kept, as a plan per engine asks
    again)."""
    with torch.device("meta"):
        model = build_backbone(name, embedding_size=dim)
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


@functools.cache
def backbone_flops(name: str, dim: int = 512) -> float:
    """Forward flops per 112x112 image (torch's FlopCounterMode on the meta device)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build_backbone(name, embedding_size=dim)
        with FlopCounterMode(display=False) as counter:
            model(torch.empty(2, 3, 112, 112))
    return counter.get_total_flops() / 2


def activations_per_image(name: str, precision: str, checkpointing: int = 0) -> int:
    """The table's entry (fp16 counts as bf16), or a measurement now (CPU-seconds); with
    ``checkpointing = k > 0`` (ViTs) see :func:`checkpointed_activations`."""
    key = (name, "fp32" if precision == "fp32" else "bf16")
    known = figures().activations
    plain = known[key] if key in known else measure_activations(*key)
    return checkpointed_activations(plain, *key, checkpointing) if checkpointing else plain


def checkpointed_activations(plain: int, name: str, precision: str, every: int) -> int:
    """Activation bytes per image of a ViT whose every ``every``-th block is checkpointed:
    each of those ``n`` blocks keeps only its input (``[tokens, width]`` fp32: the residual
    stream stays fp32 under autocast) instead of its saved tensors ``B``, and the backward
    holds one recomputed block's ``B`` at a time: ``plain - n (B - input) + B``."""
    if not name.startswith("vit_"):
        raise PlanError(f"--checkpointing={every}: modelled for the ViTs only (their blocks "
                        f"are alike), not {name!r}")
    key = (name, precision)
    blocks = figures().block_activations
    block = blocks[key] if key in blocks else measure_block_activations(*key)
    with torch.device("meta"):
        model = build_backbone(name)
    kept = int(vit.TOKENS * (1 - model.mask_ratio))
    n = len(range(0, len(model.blocks), every))
    return plain - n * (block - kept * model.width * 4) + block


def recomputed_share(name: str, every: int) -> float:
    """The share of a ViT's blocks that ``backbone.checkpointing=every`` recomputes."""
    with torch.device("meta"):
        depth = len(build_backbone(name).blocks)
    return len(range(0, depth, every)) / depth


def _per_image(model: torch.nn.Module, precision: str) -> int:
    """Saved-for-backward bytes at batch 4 minus batch 2, halved (the batch-independent
    part, e.g. autocast's weight copies, cancels)."""
    a2, a4 = (memory.activation_bytes(model, b, precision) for b in (2, 4))
    return (a4 - a2) // 2


def _vit_sized(name: str, depth: int) -> torch.nn.Module:
    """The ViT ``name`` with ``depth`` blocks and zero weights: the bytes autograd saves do
    not depend on the values, and skipping the random initialisation of ViT-L's 85 M-weight
    feature layer saves most of a measurement's time."""
    with torch.device("meta"):
        model = build_backbone(name, depth=depth)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            t.zero_()
    return model


@functools.cache
def _vit_at_depths(name: str, precision: str) -> tuple[int, int]:
    """Activation bytes per image of the ViT at depth 2 and at depth 3."""
    torch.manual_seed(0)  # the same masking draws every time
    two, three = (_per_image(_vit_sized(name, d), precision) for d in (2, 3))
    return two, three


def measure_block_activations(name: str, precision: str) -> int:
    """Saved-for-backward bytes per image of one ViT block: the model at depth 3 minus depth 2
    (blocks after the first are alike: same width, tokens and stochastic depth)."""
    two, three = _vit_at_depths(name, precision)
    return three - two


@functools.cache
def measure_activations(name: str, precision: str) -> int:
    """Activation bytes per image (:func:`_per_image`). A ViT is measured at depth 2 and
    extended by :func:`measure_block_activations` per further block (exact: seconds instead
    of minutes of CPU for ViT-L/H)."""
    if name.startswith("vit_"):
        with torch.device("meta"):
            depth = len(build_backbone(name).blocks)
        two, three = _vit_at_depths(name, precision)
        return two + (depth - 2) * (three - two)
    return _per_image(build_backbone(name), precision)


@dataclass(frozen=True)
class CollectiveTime:
    """One collective of a step: ``partial_fc.memory.Collective`` with its modelled time."""

    name: str
    kind: str
    bytes: int
    traffic_bytes_per_gpu: int
    seconds: float


@dataclass(frozen=True)
class PlanResult:
    """What :func:`plan` finds for ``inputs`` (bytes per GPU, seconds); ``--json`` prints it."""

    inputs: Inputs
    backbone_params: int
    classes_per_gpu: int
    sampled_classes_per_gpu: int
    sampled_rows_per_gpu: int  # weight rows: K per class with margin.subcenters
    weight_bytes_per_gpu: int
    head_state_bytes_per_gpu: int
    head_grad_bytes_per_gpu: int
    head_working_bytes_per_gpu: int
    backbone_param_bytes_per_gpu: int
    backbone_grad_bytes_per_gpu: int
    backbone_state_bytes_per_gpu: int
    activation_bytes_per_gpu: int
    reserve_bytes_per_gpu: int
    peak_bytes_per_gpu: int
    gpu_memory_bytes: int
    fits: bool
    max_classes: int
    link: str  # "intra-node" or "inter-node"
    link_bytes_per_s: float
    collectives: list[CollectiveTime]
    comm_seconds: float
    loader_images_per_s_per_gpu: float  # the images/s one GPU's backbone takes (H100 step)
    loader_workers_per_gpu: float  # loader workers (CPU cores) that feed it
    loader_workers_per_node: int


@dataclass(frozen=True)
class StepTime:
    """:func:`step_model`'s modelled step on H100s (seconds; images/s; backbone share)."""

    backbone_s: float
    head_s: float
    head_comm_s: float
    grad_sync_exposed_s: float
    step_s: float
    images_per_s: float
    efficiency: float


def plan(inp: Inputs) -> PlanResult:
    """Memory, collectives and the largest class count that fits, for ``inp``."""
    params, trainable = backbone_params(inp.backbone, inp.dim)
    act = activations_per_image(inp.backbone, inp.precision, inp.checkpointing) * inp.batch
    bb = memory.backbone_state_bytes(params, inp.gpus, trainable=trainable, engine=inp.engine,
                                     precision=inp.precision, zero_stage=inp.zero_stage,
                                     optimizer=inp.optimizer)
    fixed = sum(bb.values()) + act + int(inp.reserve * GIB)
    limit = int(inp.gpu_memory * GIB)

    def head(classes: int) -> memory.HeadMemory:
        return memory.head_memory(
            classes, inp.gpus, inp.dim, inp.batch * inp.gpus, inp.sample_rate,
            max_tile_bytes=inp.max_tile_mib << 20, max_update_bytes=inp.max_update_mib << 20,
            state_dtype=inp.state_dtype, optimizer=inp.optimizer, precision=inp.precision,
            row_sparse_grad=inp.row_sparse_grad, subcenters=inp.subcenters)

    h = head(inp.classes)
    peak = fixed + h.total
    multi_node = inp.gpus > inp.gpus_per_node
    bw = (inp.inter_bw if multi_node else inp.intra_bw) * 1e9
    colls = [CollectiveTime(c.name, c.kind, c.nbytes, round(c.traffic(inp.gpus)),
                            memory.collective_seconds(c, inp.gpus, bw, inp.latency_us * 1e-6))
             for c in memory.step_collectives(inp.batch, inp.gpus, inp.dim, trainable,
                                              engine=inp.engine, precision=inp.precision,
                                              zero_stage=inp.zero_stage)]
    return PlanResult(
        inputs=inp, backbone_params=params, classes_per_gpu=h.num_local,
        sampled_classes_per_gpu=h.sampled, sampled_rows_per_gpu=h.rows,
        weight_bytes_per_gpu=h.weight,
        head_state_bytes_per_gpu=h.optimizer_state, head_grad_bytes_per_gpu=h.gradient,
        head_working_bytes_per_gpu=h.working, backbone_param_bytes_per_gpu=bb["parameters"],
        backbone_grad_bytes_per_gpu=bb["gradients"],
        backbone_state_bytes_per_gpu=bb["optimizer_state"], activation_bytes_per_gpu=act,
        reserve_bytes_per_gpu=int(inp.reserve * GIB), peak_bytes_per_gpu=peak,
        gpu_memory_bytes=limit, fits=peak <= limit,
        max_classes=memory.largest_fitting(lambda c: fixed + head(c).total, limit, inp.gpus),
        link="inter-node" if multi_node else "intra-node", link_bytes_per_s=bw,
        collectives=colls, comm_seconds=sum(c.seconds for c in colls), **loader_need(inp))


def loader_need(inp: Inputs) -> dict:
    """The CPU loader that keeps one GPU busy: the backbone's modelled images/s on an H100
    (iresnet50's measured step, scaled by flops) over one worker's rate; per GPU (a fraction:
    ``data.num_workers`` is its ceiling) and per node."""
    per_image = backbone_flops(inp.backbone, inp.dim) / backbone_flops("iresnet50")
    rate = figures().r50_images_per_s / per_image
    workers = rate / figures().loader_images_per_s
    return {"loader_images_per_s_per_gpu": rate, "loader_workers_per_gpu": workers,
            "loader_workers_per_node": math.ceil(workers * inp.gpus_per_node)}


def step_model(result: PlanResult, head_factor: float) -> StepTime:
    """Modelled step time on H100s: the backbone's measured single-GPU step (scaled by flops
    from iresnet50 and by batch), the head at ``head_factor`` x its matmul time, the head's
    collectives in full, and the backbone's gradient sync minus the backward it overlaps
    (DDP buckets; backward ~ 2/3 of the backbone step); checkpointed blocks run their
    forward twice."""
    inp = result.inputs
    per_image = backbone_flops(inp.backbone, inp.dim) / backbone_flops("iresnet50")
    t_bb = inp.batch * per_image / figures().r50_images_per_s
    if inp.checkpointing:  # a recomputed block: one more forward, ~1/3 of its step
        t_bb *= 1 + recomputed_share(inp.backbone, inp.checkpointing) / 3
    flops = memory.head_matmul_flops(inp.batch * inp.gpus, result.sampled_rows_per_gpu,
                                     inp.dim)
    t_head = head_factor * flops / figures().head_matmul_flops_per_s
    grads = [c.seconds for c in result.collectives if c.name.startswith("backbone")]
    t_head_comm = result.comm_seconds - sum(grads)
    t_sync = max(0.0, sum(grads) - 2 / 3 * t_bb)
    step = t_bb + t_head + t_head_comm + t_sync
    return StepTime(backbone_s=t_bb, head_s=t_head, head_comm_s=t_head_comm,
                    grad_sync_exposed_s=t_sync, step_s=step,
                    images_per_s=inp.batch * inp.gpus / step, efficiency=t_bb / step)


def accumulated_step(one: StepTime, batch: int, gpus: int, passes: int,
                     statistics_pass: bool) -> StepTime:
    """A step of ``passes`` micro-batch passes of :func:`step_model`'s pass ``one`` (a
    ``train.global_batch`` step on fewer GPUs): each pass's backbone, head and head
    collectives, the backbone's gradient sync once (the passes before the last accumulate
    without it), and with ``statistics_pass`` and more than one pass, one forward without
    grad per micro-batch first (a third of its backbone step; trainer.engine.step_statistics)."""
    extra = 1 / 3 if statistics_pass and passes > 1 else 0.0
    backbone = passes * one.backbone_s * (1 + extra)
    head, comm = passes * one.head_s, passes * one.head_comm_s
    step = backbone + head + comm + one.grad_sync_exposed_s
    return StepTime(backbone_s=backbone, head_s=head, head_comm_s=comm,
                    grad_sync_exposed_s=one.grad_sync_exposed_s, step_s=step,
                    images_per_s=batch * gpus * passes / step,
                    efficiency=passes * one.backbone_s / step)
