"""Deterministic class-weight initialisation, independent of the number of ranks.

Row ``k`` of the full ``[C, D]`` matrix is a function of ``(seed, k)`` only, so a class gets
the same initial row whether the head runs on 1 rank or 64, and no rank ever materialises
the full matrix (29 M x 512 fp32 is 59 GB). Classes are grouped in fixed blocks of
``BLOCK`` rows; block ``b`` is drawn from its own CPU generator seeded by
``derive_seed(seed, b)``, and each rank draws only the blocks that overlap its rows.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

__all__ = ["BLOCK", "derive_seed", "init_rows_"]

BLOCK = 4096  # classes per generator block; part of the definition of the initial weights


def derive_seed(*keys: int) -> int:
    """A 63-bit seed from non-negative ints (e.g. ``(seed, block)`` or ``(seed, step, rank)``),
    well mixed by NumPy's SeedSequence so neighbouring keys give unrelated streams."""
    if any(k < 0 for k in keys):
        raise ValueError(f"derive_seed: keys {keys} must be >= 0")
    state = np.random.SeedSequence(list(keys)).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


@torch.no_grad()
def init_rows_(weight: Tensor, class_start: int, seed: int, std: float = 0.01) -> Tensor:
    """Fill ``weight`` (``[num_local, D]``, rows ``class_start ..``, on any device) in place
    with ``N(0, std^2)`` rows that depend only on ``(seed, global class index)``; returns it.
    The rows are drawn on the CPU, one block at a time, and copied into ``weight``.

    ``std = 0.01`` is insightface's choice; the head normalises rows, so only the norm's
    interplay with the learning rate and weight decay depends on it. The blocks are drawn in
    ``torch.get_num_threads()`` threads (each its own generator, so the values do not depend
    on the thread count): one CPU generator draws about 100M values/s, and a 30M-class shard
    (15G values at D = 512) would otherwise take two to three minutes before the first step.
    """
    num_local, dim = weight.shape
    end = class_start + num_local
    blocks = list(range(class_start // BLOCK, (end - 1) // BLOCK + 1 if num_local else 0))

    def draw(block: int) -> Tensor:
        gen = torch.Generator().manual_seed(derive_seed(seed, block))
        return torch.randn(BLOCK, dim, generator=gen, dtype=torch.float32).mul_(std)

    # Draws in the threads; copies into ``weight`` (perhaps on a GPU) from this thread alone,
    # a window of blocks at a time, so at most 4 blocks per thread wait in host memory.
    workers = max(1, torch.get_num_threads())
    with ThreadPoolExecutor(workers) as pool:
        for first in range(0, len(blocks), 4 * workers):
            window = blocks[first: first + 4 * workers]
            for block, rows in zip(window, pool.map(draw, window), strict=True):
                lo, hi = max(class_start, block * BLOCK), min(end, (block + 1) * BLOCK)
                weight[lo - class_start: hi - class_start] = rows[lo - block * BLOCK:
                                                                  hi - block * BLOCK]
    return weight
