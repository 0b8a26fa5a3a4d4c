"""Memory and communication of one training step, per GPU: the formulas behind
``python -m launch.plan`` (bytes, never guesses: each term names the tensors it counts).

Head (``partial_fc.head.PartialFC`` with ``partial_fc.optim``), on the rank holding the most
classes, ``C_local = ceil(C / P)``, with ``N = P * n`` embeddings in the global batch and
``S`` sampled rows (``partial_fc.sampling.sample_size``, and at least the distinct positives
this rank owns: ``C_local (1 - exp(-N / C))`` expected for uniformly drawn labels):

- weight ``C_local * D``; optimizer state: SGD momentum ``C_local * D``, AdamW two moments
  ``2 C_local * D`` (these in the weight's dtype, ``state_dtype``) plus per-row fp32 step
  counts ``C_local``;
- gradient: dense ``C_local * D`` (``weight.grad``) at ``S = C_local``, else ``S * D`` values
  plus ``S`` int64 indices: the head's row-sparse COO gradient (``row_sparse_grad=False``
  models the dense one of earlier heads), in the weight's dtype;
- working memory of one forward + backward (freed when the step ends), for the class-chunked
  head (``partial_fc.tiles.reference``, at most ``chunk = chunk_columns(N, max_tile_bytes)`` columns
  of fp32 ``[N, chunk]`` tiles at once): the gathered embeddings and their gradient
  ``2 N D`` fp32; at r < 1 the gathered rows ``W_s`` (and, for a dense gradient, their fp32
  gradient before it is scattered, ``S D``); in backward two tiles (cosines, ``G``: the
  gradient rows of an fp32 weight are written in place, a bf16 weight's through one fp32
  ``[chunk, D]``); with bf16 autocast or a bf16 weight the rounded operand copies. The Triton
  kernels hold tiles only: this is the torch path's figure, an upper bound;
- or, when larger, the optimizer step (``partial_fc.optim``): per chunk of at most
  ``rows_per_chunk(max_update_bytes, D, temporaries)`` rows, fp32 ``[rows, D]`` copies of the
  weight, its state and (bf16) its gradient, plus the formula's scratch tensors; at
  ``S = C_local`` an fp32 weight and state are updated in place (scratch only).

tests/offline/test_plan.py measures the gradient plus the working memory within 0.8-1.25x.
:func:`tensor_bytes` counts a sparse gradient through ``_indices()/_values()``, PyTorch's
documented accessors for an uncoalesced COO tensor (the head's accumulated ``weight.grad``
is one), because the public ``indices()/values()`` would need a ``coalesce()`` copy.

Backbone with ``Psi`` parameters (ZeRO, arXiv:1910.02054 Sec. 3.1 and 5.1): DDP keeps fp32
parameters, fp32 gradients and fp32 optimizer state (``K = 4`` bytes SGD momentum, 8 Adam)
on every rank, also under bf16 autocast. DeepSpeed in bf16/fp16 keeps half-precision
parameters and gradients (2 + 2 bytes) plus fp32 master weights and state (``K = 8`` SGD,
12 Adam); stage 1 shards ``K`` over the ``P`` data-parallel ranks, stage 2 also the
gradients. Activations: a measured number of bytes per image (:func:`activation_bytes`).

Collectives per step (ring algorithms; per-rank traffic over the slowest link): all-gather
and reduce-scatter move ``(P-1)/P * bytes`` of the full tensor, all-reduce twice that
(``2 (P-1)/P * bytes``), plus a latency of ``2 ceil(log2 P)`` link hops (NCCL's trees for
small messages).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from partial_fc.optim import SampledAdamW, SampledSGD, rows_per_chunk
from partial_fc.sampling import sample_size
from partial_fc.tiles.reference import chunk_columns

__all__ = [
    "Collective", "HeadMemory", "activation_bytes", "backbone_state_bytes",
    "collective_seconds", "head_matmul_flops", "head_memory", "head_update_bytes",
    "largest_fitting",
    "step_collectives", "tensor_bytes",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
HEAD_MATMULS = 3  # forward cos = E W^T, backward dE and dW: 2 N S D flops each
_OPTIMIZER_COPIES = {"sgd": 1, "adamw": 2}  # fp32 state tensors per backbone parameter
_HEAD_OPTIMIZERS = {"sgd": SampledSGD, "adamw": SampledAdamW}


@dataclass(frozen=True)
class HeadMemory:
    """Per-GPU bytes of the sharded head on the rank holding the most classes; ``num_local``
    and ``sampled`` count classes, ``rows`` the sampled weight rows (``K`` per class)."""

    num_local: int
    sampled: int
    rows: int
    weight: int
    optimizer_state: int
    gradient: int
    working: int

    @property
    def total(self) -> int:
        return self.weight + self.optimizer_state + self.gradient + self.working

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def head_memory(
    num_classes: int, world_size: int, dim: int, global_batch: int, sample_rate: float = 1.0,
    *, max_tile_bytes: int, max_update_bytes: int, state_dtype: str = "fp32",
    optimizer: str = "sgd", precision: str = "fp32", row_sparse_grad: bool = True,
    subcenters: int = 1,
) -> HeadMemory:
    """Bytes of the head's weight, optimizer state, gradient and working memory per GPU.

    Args:
        num_classes, world_size: ``C`` and ``P``; ``dim``: ``D``; ``global_batch``: ``N``.
        max_tile_bytes: the head's budget for one fp32 ``[N, chunk]`` tile (``PartialFC``'s
            ``max_tile_bytes``; ``chunk`` from ``partial_fc.tiles.reference.chunk_columns``).
        max_update_bytes: the head optimizer's budget for the fp32 temporaries of one chunk
            of rows (``SampledSGD`` / ``SampledAdamW``'s ``max_update_bytes``).
        state_dtype: dtype of weight, gradient and optimizer state (``fp32`` | ``bf16``;
            AdamW's step counts are fp32 either way).
        optimizer: ``sgd`` (momentum) | ``adamw``.
        precision: the backbone's autocast (``bf16``/``fp16``: the matmul operands are
            rounded copies).
        row_sparse_grad: the gradient holds only the sampled rows (as ``PartialFC`` keeps it
            at r < 1; False models a dense one).
        subcenters: ``K`` weight rows per class (``partial_fc.subcenters``): K x the weight,
            its optimizer state, gradient and sampled rows; the torch tile path's chunk of
            ``chunk / K`` classes holds ``[N, chunk]`` centre cosines and their spread
            gradient plus two ``[N, chunk / K]`` class tiles. The step's collectives do not
            change (the max over a class's K rows stays on its shard).
    """
    k = subcenters
    c_local = -(-num_classes // world_size)
    state = DTYPE_BYTES[state_dtype]
    head_opt = _HEAD_OPTIMIZERS[optimizer]
    positives = math.ceil(c_local * -math.expm1(-global_batch / num_classes))
    sampled = max(sample_size(sample_rate, c_local), min(positives, c_local))
    weight = k * c_local * dim * state
    opt = head_opt.ROW_STATE * weight + (4 * k * c_local if optimizer == "adamw" else 0)
    if row_sparse_grad and sampled < c_local:
        grad = k * sampled * (dim * state + 8)
    else:
        grad = weight
    n, narrow = global_batch, state != 4
    rounded = narrow or precision in ("bf16", "fp16")  # 16-bit matmul operands
    chunk = min(max(1, chunk_columns(n, max_tile_bytes) // k), sampled)  # classes
    # the fp32 input copy, E, dL/dE and normalise's backward (+ the operand copies)
    emb = 4 * n * dim * 4 + (n * dim * 6 if rounded else 0)
    rows = 0
    if sampled < c_local:  # W_s, and dL/dW_s unless it is the sparse gradient itself
        rows = k * sampled * dim * (state + (0 if row_sparse_grad else 4))
    # backward, per chunk: the cos and G tiles (K > 1: of the centres, plus the classes')
    tiles = (2 * k + (2 if k > 1 else 0)) * n * chunk * 4
    tiles += k * chunk * dim * 4 * (rounded + narrow)  # the rows as the matmul saw them; bf16 dW
    update = head_update_bytes(k * c_local, k * sampled, dim, max_update_bytes=max_update_bytes,
                               state_dtype=state_dtype, optimizer=optimizer)
    return HeadMemory(c_local, sampled, k * sampled, weight, opt, grad,
                      max(emb + rows + tiles, update))


def head_update_bytes(num_local: int, rows: int, dim: int, *, max_update_bytes: int,
                      state_dtype: str = "fp32", optimizer: str = "sgd",
                      fused: bool = True) -> int:
    """Peak temporaries of one ``partial_fc.optim`` step updating ``rows`` of ``num_local``
    rows (one forward per step), a chunk of rows at a time: fp32 copies of the weight and its
    state (none for an fp32 weight when all rows are updated: slices, in place) and of a bf16
    gradient, plus the update formula's scratch tensors. None at all where ``SampledSGD``'s
    ``fused`` step takes every row of an fp32 weight in torch's fused kernel."""
    head_opt, narrow = _HEAD_OPTIMIZERS[optimizer], state_dtype != "fp32"
    if fused and optimizer == "sgd" and rows == num_local and not narrow:
        return 0
    copies = (1 + head_opt.ROW_STATE + narrow) if rows < num_local or narrow else 0
    per_chunk = rows_per_chunk(max_update_bytes, dim, head_opt.temporaries())
    return min(rows, per_chunk) * dim * 4 * (head_opt.SCRATCH + copies)


def backbone_state_bytes(
    params: int, world_size: int, *, trainable: int | None = None, engine: str = "ddp",
    precision: str = "fp32", zero_stage: int = 0, optimizer: str = "sgd",
) -> dict[str, int]:
    """Per-GPU bytes of the backbone's ``parameters``, ``gradients`` and ``optimizer_state``
    (master weights included) for ``params`` parameters of which ``trainable`` (default all)
    get gradients and state, after ZeRO sharding."""
    trainable = params if trainable is None else trainable
    copies = _OPTIMIZER_COPIES[optimizer]
    if engine == "deepspeed" and precision in ("bf16", "fp16"):
        p_bytes, g_bytes, k_bytes = 2, 2, 4 * (copies + 1)  # fp32 master + state
    else:
        p_bytes, g_bytes, k_bytes = 4, 4, 4 * copies
    shard_state = engine == "deepspeed" and zero_stage >= 1
    shard_grad = engine == "deepspeed" and zero_stage >= 2
    return {
        "parameters": params * p_bytes,
        "gradients": -(-trainable * g_bytes // world_size) if shard_grad
        else trainable * g_bytes,
        "optimizer_state": -(-trainable * k_bytes // world_size) if shard_state
        else trainable * k_bytes,
    }


@dataclass(frozen=True)
class Collective:
    """One collective of a step: ``kind`` (all_gather | reduce_scatter | all_reduce) over a
    full tensor of ``nbytes`` (the gathered / reduced size, not one rank's piece)."""

    name: str
    kind: str
    nbytes: int

    def traffic(self, world_size: int) -> float:
        """Bytes each rank sends (ring algorithm)."""
        share = (world_size - 1) / world_size
        return (2 * share if self.kind == "all_reduce" else share) * self.nbytes


def step_collectives(
    batch: int, world_size: int, dim: int, backbone_params: int, *, engine: str = "ddp",
    precision: str = "fp32", zero_stage: int = 0,
) -> list[Collective]:
    """The collectives of one step with ``batch`` images per rank (``PartialFC.forward`` and
    backward, and the backbone's gradient synchronisation)."""
    n = batch * world_size
    half = engine == "deepspeed" and precision in ("bf16", "fp16")
    grad_bytes = backbone_params * (2 if half else 4)
    out = [
        Collective("batch sizes (int64 x2)", "all_gather", 16 * world_size),
        Collective("embeddings fp32 [N, D]", "all_gather", n * dim * 4),
        Collective("labels int64 [N]", "all_gather", n * 8),
        Collective("statistics fp64 [2N+2]", "all_reduce", (2 * n + 2) * 8),
        Collective("softmax max fp32 [N]", "all_reduce", n * 4),
        Collective("softmax sum-exp, target fp32 [2, N]", "all_reduce", 2 * n * 4),
        Collective("embedding grad fp32 [N, D]", "reduce_scatter", n * dim * 4),
    ]
    if engine == "deepspeed" and zero_stage >= 1:
        out += [Collective("backbone grads", "reduce_scatter", grad_bytes),
                Collective("backbone params", "all_gather", grad_bytes)]
    else:
        out.append(Collective("backbone grads", "all_reduce", grad_bytes))
    return out


def collective_seconds(c: Collective, world_size: int, bandwidth: float, latency: float) -> float:
    """Time of ``c`` at ``bandwidth`` bytes/s per rank and ``latency`` s per hop."""
    if world_size == 1:
        return 0.0
    return c.traffic(world_size) / bandwidth + 2 * math.ceil(math.log2(world_size)) * latency


def largest_fitting(peak: Callable[[int], int], limit: int, low: int, high: int = 10**13) -> int:
    """The largest ``C`` in ``[low, high]`` with ``peak(C) <= limit`` (``peak`` nondecreasing),
    by bisection; ``low - 1`` when even ``low`` does not fit."""
    if peak(low) > limit:
        return low - 1
    if peak(high) <= limit:
        return high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if peak(mid) <= limit else (low, mid)
    return low


def head_matmul_flops(global_batch: int, sampled: int, dim: int) -> int:
    """Flops of the head's three ``[N, D] x [D, S]``-sized matmuls in one step."""
    return HEAD_MATMULS * 2 * global_batch * sampled * dim


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds (a sparse COO tensor: its indices and values)."""
    if t.is_sparse:
        return tensor_bytes(t._indices()) + tensor_bytes(t._values())
    return t.numel() * t.element_size()


def activation_bytes(model: nn.Module, batch: int, precision: str = "fp32",
                     size: int = 112) -> int:
    """Bytes of the tensors autograd saves for backward in one forward of ``batch`` random
    ``[3, size, size]`` images on the CPU (torch's ``saved_tensors_hooks``; each storage
    counted once, parameters excluded): the activation memory held when backward starts.
    ``precision`` bf16/fp16 runs the forward under CPU autocast in that dtype."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    x = torch.randn(batch, 3, size, size)
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        model(x)
    return sum(seen.values())
