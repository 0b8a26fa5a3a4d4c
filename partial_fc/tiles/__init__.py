"""Back-ends of the head's two class-tile passes, behind one small Protocol.

A back-end computes, for this rank's (sampled) weight rows, the forward's per-row softmax
statistics (``class_tile_stats``) and the backward's gradients recomputed tile by tile
(``class_tile_grads``), never an ``[N, S]`` tensor (``partial_fc.softmax`` has the loss around
them). Two implement it: ``reference`` (PyTorch, chunked over classes within a memory budget;
the CPU path and the kernels' reference) and ``triton`` (CUDA kernels, an optional dependency:
nothing here imports triton, and ``partial_fc.tiles.triton`` without it raises an
``ImportError`` naming the fix; their launch configuration, Triton GEMMs or the cuBLAS engine
of ``cublas`` and its tiles, is chosen by measurement per device and shape: ``tuning``,
``autotune``). ``KERNELS`` names the choices for the head and the config
schema; ``select`` turns a choice and a device into a back-end.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch
from torch import Tensor

from partial_fc.tiles.reference import ReferenceTiles

__all__ = ["KERNELS", "ReferenceTiles", "TileBackend", "select", "triton_available"]

KERNELS = ("auto", "torch", "triton")


class TileBackend(Protocol):
    """The class-tile passes (``docs/kernels.md`` has the semantics). ``e [N, D]``: operand
    embeddings; ``w [S, D]``: weight rows, not normalised; ``inv_norm [S]`` fp32 ``1 / ||w_k||``;
    ``target_col [N]`` int64, row ``i``'s target column in ``w`` or ``-1``; ``s``: the scale."""

    def class_tile_stats(self, e: Tensor, w: Tensor, inv_norm: Tensor, target_col: Tensor,
                         s: Tensor | float) -> tuple[Tensor, Tensor, Tensor]:
        """``(row_max, row_sum, cos_sum)`` ``[N]`` fp32 over the non-target columns."""
        ...

    def class_tile_grads(self, e: Tensor, w: Tensor, inv_norm: Tensor, target_col: Tensor,
                         s: Tensor | float, lse: Tensor, coef: Tensor,
                         target_grad: Tensor) -> tuple[Tensor, Tensor]:
        """``(grad_e [N, D] fp32, grad_w [S, D] in w.dtype)``."""
        ...


def triton_available() -> bool:
    """Whether ``import triton`` would find a package (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def select(kernel: str, device: torch.device, max_tile_bytes: int) -> TileBackend:
    """The back-end for ``kernel`` (one of ``KERNELS``) on ``device``: ``"auto"`` is triton
    for CUDA tensors when triton is installed, else the reference; ``max_tile_bytes`` is the
    reference's budget of fp32 ``[N, chunk]`` cosines (the kernels hold tiles only)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} must be one of {KERNELS}")
    if kernel == "triton" or (kernel == "auto" and device.type == "cuda" and triton_available()):
        from partial_fc.tiles import autotune  # triton: an optional dependency, CUDA only
        return autotune.TUNED
    return ReferenceTiles(max_tile_bytes)
