"""The checks of ``partial_fc.head.PartialFC``: its constructor's arguments, and each forward's
inputs against every rank's batch size. Each error is one line naming the value and what was
expected.

The rules a config or a plan states about the head too are written here once, as the text that
follows ``KEY=VALUE: ``: :data:`SAMPLE_RATE` and :data:`SUBCENTERS` (ranges),
:func:`triton_subcenters_rule`. ``trainer.config``'s schema and checks and ``launch.plan``'s
inputs call them, each naming the key in its own spelling (``head.sample_rate``,
``--sample-rate``, ``sample_rate``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from partial_fc import distributed as dist_ops
from partial_fc.margins import Margin
from partial_fc.margins.keys import Bounds, SharedConfig, bounds_of
from partial_fc.tiles import KERNELS, triton_available

__all__ = ["INITS", "SAMPLE_RATE", "STATE_DTYPES", "SUBCENTERS", "check_head_args",
           "check_inputs", "check_label_range", "triton_subcenters_rule"]

STATE_DTYPES = (torch.float32, torch.bfloat16)
INITS = ("per_class", "per_rank")
# The share of a rank's classes each step's softmax covers: 1 = all, 0 = the batch's own only
# (partial_fc.sampling takes at least one class per rank).
SAMPLE_RATE = Bounds(ge=0, le=1)
# Centres per class (sub-center ArcFace), declared with the margin keys (margin.subcenters).
SUBCENTERS = bounds_of(SharedConfig, "subcenters")


def triton_subcenters_rule(kernel: str, subcenters: int, key: str = "subcenters") -> str | None:
    """Why ``kernel`` cannot run a head of ``subcenters`` centres per class (``key``: how the
    caller spells that setting), or None: the Triton kernels take no K-way max."""
    if subcenters > 1 and kernel == "triton":
        return (f"the Triton kernels have no K-way max for {key}={subcenters} (use the auto or "
                "torch kernel)")
    return None


def check_head_args(embedding_size: int, num_classes: int, world: int, margin: Margin,
                    sample_rate: float, seed: int, kernel: str, max_tile_bytes: int,
                    state_dtype: torch.dtype, init: str, loss_cap: float | None,
                    subcenters: int) -> None:
    """Raise on the first of ``PartialFC``'s arguments out of range (``world``: the size of its
    process group); the arguments are as in ``PartialFC``."""
    if embedding_size < 1:
        raise ValueError(f"PartialFC: embedding_size={embedding_size} must be >= 1")
    if num_classes < world:
        raise ValueError(
            f"PartialFC: num_classes={num_classes} < world size {world}: every rank needs "
            "at least one class"
        )
    if broken := SAMPLE_RATE.rule(sample_rate):
        raise ValueError(f"PartialFC: sample_rate={sample_rate}: {broken}")
    if not isinstance(margin, Margin):
        raise TypeError(f"PartialFC: margin must come from build_margin, got {margin!r}")
    if seed < 0:
        raise ValueError(f"PartialFC: seed={seed} must be >= 0")
    if kernel not in KERNELS:
        raise ValueError(f"PartialFC: kernel={kernel!r} must be one of {KERNELS}")
    if not isinstance(subcenters, int) or SUBCENTERS.rule(subcenters):
        raise ValueError(f"PartialFC: subcenters={subcenters!r}: must be {SUBCENTERS.text()}")
    if broken := triton_subcenters_rule(kernel, subcenters):
        raise ValueError(f"PartialFC: kernel={kernel!r}: {broken}")
    if kernel == "triton" and not triton_available():
        raise ValueError("PartialFC: kernel='triton' needs triton (pip install triton); "
                         "use kernel='torch' or 'auto'")
    if max_tile_bytes < 1:
        raise ValueError(f"PartialFC: max_tile_bytes={max_tile_bytes} must be >= 1")
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"PartialFC: state_dtype={state_dtype} must be one of "
                         f"{STATE_DTYPES}")
    if init not in INITS:
        raise ValueError(f"PartialFC: init={init!r} must be one of {INITS}")
    if loss_cap is not None and not loss_cap > 0:
        raise ValueError(f"PartialFC: loss_cap={loss_cap} must be > 0 or None")


def check_inputs(embeddings: Tensor, labels: Tensor, sizes: Sequence[int] | None,
                 embedding_size: int, world_size: int, rank: int,
                 process_group: dist_ops.ProcessGroup) -> list[int]:
    """Every rank's batch size, after validating shapes (``embeddings [n, embedding_size]``
    float, ``labels [n]`` integer) for a head built for ``world_size`` ranks, on ``rank``.
    Without ``sizes``: on every rank at once (one small all-gather, read by the host), so a bad
    rank makes all ranks raise instead of leaving the others blocked in a collective; with
    them: locally, no read."""
    world = dist_ops.get_world_size(process_group)
    if world != world_size:
        raise RuntimeError(f"PartialFC: built for world size {world_size}, "
                           f"called with {world}")
    ok = (embeddings.dim() == 2 and embeddings.shape[-1] == embedding_size
          and embeddings.is_floating_point() and labels.dim() == 1
          and labels.shape[0] == embeddings.shape[0] and not labels.is_floating_point()
          and not labels.is_complex() and labels.dtype != torch.bool)
    n = embeddings.shape[0] if embeddings.dim() else 0
    if sizes is not None:
        sizes = [int(k) for k in sizes]
        if len(sizes) != world or min(sizes) < 0:
            raise ValueError(f"PartialFC: sizes={sizes} must be {world} batch sizes >= 0")
        if not ok or n != sizes[rank]:
            raise ValueError(_bad_inputs(f"rank {rank}", sizes[rank], embedding_size,
                                         embeddings, labels))
    else:
        meta = dist_ops.gather_ints([n, int(ok)], embeddings.device, process_group)
        if not bool(meta[:, 1].all()):
            culprit = int((meta[:, 1] == 0).nonzero()[0, 0])
            raise ValueError(_bad_inputs(f"rank {culprit}", "n", embedding_size, embeddings,
                                         labels))
        sizes = meta[:, 0].tolist()
    if sum(sizes) == 0:
        raise ValueError("PartialFC: the global batch is empty")
    return sizes


def _bad_inputs(who: str, n: int | str, embedding_size: int, embeddings: Tensor,
                labels: Tensor) -> str:
    return (f"PartialFC: {who} passed bad inputs; expected embeddings float "
            f"[{n}, {embedding_size}] and labels int64 [{n}], this rank got embeddings "
            f"{tuple(embeddings.shape)} {embeddings.dtype}, labels {tuple(labels.shape)} "
            f"{labels.dtype}")


def check_label_range(y: Tensor, num_classes: int) -> None:
    """Raise the one-line error for the first gathered label outside ``[0, num_classes)``
    (reads the host; every rank sees the same gathered labels, so all raise together)."""
    bad = (y < 0) | (y >= num_classes)
    if bool(bad.any()):
        raise ValueError(f"PartialFC: label {int(y[bad][0])} out of range "
                         f"[0, {num_classes}) (num_classes={num_classes})")
