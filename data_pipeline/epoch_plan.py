"""Epoch plans: which samples each (rank, DataLoader worker) reads, from the manifest alone.

Pure functions of (shard counts, seed, epoch, rank, world size, worker, workers), so every
process derives the same plan without communicating, and tests run them on plain lists.

An epoch's order is a seeded permutation of the shards, read as one virtual sequence of T
samples. Rank r takes positions [r*q, (r+1)*q) with q = T // world_size, so ranks hold equal
shares (fewer than world_size samples are left out, the tail of the sequence); a shard can
straddle two ranks, which then read disjoint sample ranges of it. Each rank's range is cut
the same way into num_workers near-equal contiguous worker ranges. Batches per rank =
q // batch_size, identical on every rank; each sample is read by exactly one worker of
one rank, so it is seen at most once per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.random import default_rng  # imported once here, not in every worker

from partial_fc.partition import split_evenly


@dataclass(frozen=True)
class Piece:
    """Samples [start, stop) (positions inside one shard) of shard number `shard`, less the
    positions in `drop` (excluded samples)."""

    shard: int
    start: int
    stop: int
    drop: frozenset[int] = frozenset()


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """Shard indices in this epoch's reading order, a permutation seeded by (seed, epoch)."""
    if not shuffle:
        return list(range(num_shards))
    return [int(i) for i in default_rng([seed, epoch]).permutation(num_shards)]


def samples_per_rank(num_samples: int, world_size: int) -> int:
    return num_samples // world_size


def batches_per_rank(num_samples: int, world_size: int, batch_size: int) -> int:
    """Batches every rank yields per epoch (the loader's len, the same on all ranks)."""
    return samples_per_rank(num_samples, world_size) // batch_size


def pieces_for_range(counts: list[int], order: list[int], start: int, stop: int) -> list[Piece]:
    """The shard pieces covering positions [start, stop) of the virtual sequence `order`."""
    pieces, offset = [], 0
    for shard in order:
        lo, hi = max(start, offset), min(stop, offset + counts[shard])
        if lo < hi:
            pieces.append(Piece(shard, lo - offset, hi - offset))
        offset += counts[shard]
        if offset >= stop:
            break
    return pieces


def worker_pieces(counts: list[int], *, seed: int, epoch: int, rank: int, world_size: int,
                  worker: int, num_workers: int, shuffle: bool = True) -> list[Piece]:
    """The pieces DataLoader worker `worker` of rank `rank` reads this epoch, in order."""
    quota = samples_per_rank(sum(counts), world_size)
    w_start, w_stop = split_evenly(quota, num_workers, worker)
    base = rank * quota
    return pieces_for_range(counts, shard_order(len(counts), seed, epoch, shuffle),
                            base + w_start, base + w_stop)


def worker_sizes(num_samples: int, world_size: int, num_workers: int) -> list[int]:
    """Number of samples each worker of a rank streams per epoch (the same for every rank)."""
    quota = samples_per_rank(num_samples, world_size)
    return [b - a for a, b in (split_evenly(quota, num_workers, w) for w in range(num_workers))]


def consumed_positions(sizes: list[int], batch_size: int, samples: int) -> list[int]:
    """Per-worker stream positions after the loader handed out `samples` samples.

    Mirrors the loader: workers emit chunks of `batch_size` (the last one partial), the
    DataLoader yields them round-robin over the workers that still have chunks, and the main
    process cuts that concatenation into batches first-in first-out. Assumes no sample was
    skipped as corrupt before that point (those shift the chunks).
    """
    chunks = [[min(batch_size, n - s) for s in range(0, n, batch_size)] for n in sizes]
    positions = [0] * len(sizes)
    left = samples
    for round_ in range(max((len(c) for c in chunks), default=0)):
        for worker, worker_chunks in enumerate(chunks):
            if round_ < len(worker_chunks) and left > 0:
                take = min(left, worker_chunks[round_])
                positions[worker] += take
                left -= take
    return positions


def with_exclusions(pieces: list[Piece], counts: list[int],
                    excluded: list[np.ndarray]) -> list[Piece]:
    """Pieces planned over kept samples (shard ``s`` holds ``counts[s] - len(excluded[s])``)
    as pieces over the shards' own positions: kept sample ``k`` of shard ``s`` is the
    ``k``-th position not in the sorted array ``excluded[s]``."""
    out = []
    for piece in pieces:
        gone = excluded[piece.shard]
        if not len(gone):
            out.append(piece)
            continue
        kept = np.setdiff1d(np.arange(counts[piece.shard]), gone, assume_unique=True)
        start, stop = int(kept[piece.start]), int(kept[piece.stop - 1]) + 1
        drop = gone[(gone >= start) & (gone < stop)]
        out.append(Piece(piece.shard, start, stop, frozenset(int(i) for i in drop)))
    return out
