"""A learnable synthetic data source generated as batches on the training device: no files.

The same family of images as ``data_pipeline.synthetic`` (each identity a 4x4 random colour
grid bicubically upsampled to a 128x128 canvas plus a disc of its own colour, position and
radius; each image a random 112x112 crop of it, a brightness gain in [0.75, 1.25], Gaussian
noise of sigma 10), drawn with torch ops for a whole batch at once, so a 1M-class run (the
"does my cluster train at this scale?" check) needs no data folder and no decoding. It is not
byte-identical to the JPEG shards (no JPEG; the canvas is not rounded to uint8 before the crop).

Every random number is a counter-based hash (:func:`mix32`) of (seed, label, image index),
of (seed, epoch) for the order and of (seed, epoch, sample) for the flip: every rank, every
resume and every device count sees the same images, and nothing depends on a generator's
state.

Order: epoch e is the sequence ``perm_e(0..T-1)`` of the ``T = classes * images_per_class``
sample indices (``index = label * images_per_class + image``), ``perm_e`` a seeded Feistel
permutation (:func:`permute`): O(batch) per step, no O(T) tensor ever. Global batch b is
positions ``[b*B*W, (b+1)*B*W)``; rank r takes ``B`` consecutive ones at ``b*B*W + r*B``. So
every rank yields ``T // (B*W)`` batches of ``B`` (the trainer's equal batches), the ranks
together see each sample of the epoch at most once, and the last ``T mod (B*W)`` positions
are the epoch's drop (``dropped_fraction``).

The interface is :class:`data_pipeline.epoch_batches.EpochBatches`', as ``launch.train`` uses it:
``len``, iteration (uint8 ``[B, 3, 112, 112]`` images and int64 ``[B]`` labels, on
``device``; normalisation stays in the engine), ``set_epoch``, ``epoch``, ``batches_done``,
``position``/``restore`` (``state_dict``/``load_state_dict`` at a checkpoint),
``dropped_fraction``, ``num_skipped``, ``num_padded``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from data_pipeline.epoch_batches import EpochBatches
from data_pipeline.errors import DataError
from data_pipeline.position import SyntheticPlan, SyntheticPosition

SIZE = 112
CANVAS = 128
GRID = 4
NOISE_SIGMA = 10.0
MASK32 = 0xFFFFFFFF
# Stream salts: one hash stream per kind of random number.
_CLASS, _IMAGE, _NOISE, _FLIP, _ORDER = 0x1B873593, 0x0C6A4A7B, 0x165667B1, 0x27D4EB2F, 0x2F0F3D5B
_BYTES4_STD = math.sqrt(4 * (256**2 - 1) / 12)  # std of a sum of 4 uniform bytes
_CLASS_PARAMS = 3 * GRID * GRID + 6  # grid colours, disc centre (y, x), radius, disc colour


def _i32(value: int) -> int:
    """The int32 with the bit pattern of ``value`` mod 2^32."""
    value &= MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply, three rounds) of int32 ``x``, read as
    uint32 bit patterns: products wrap modulo 2^32 and right shifts are masked to be
    logical (tests/data_pipeline/test_data_synthetic_stream.py checks it against Python
    integers)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * 0x5BD1E995
    return x ^ ((x >> 16) & 0xFFFF)


def hash_ints(*values: torch.Tensor | int) -> torch.Tensor:
    """Hash a sequence of integers (Python ints, or broadcastable integer tensors in
    [0, 2^31)) into one int32 tensor of hash bits."""
    h = torch.tensor(_i32(0x9E3779B9), dtype=torch.int32)
    for v in values:
        h = mix32(h + (_i32(v) if isinstance(v, int) else v.to(torch.int32)))
    return h


def uniform(h: torch.Tensor) -> torch.Tensor:
    """int32 hash bits -> float32 uniforms in [0, 1) (their top 24 bits, exact)."""
    return ((h >> 8) & 0xFFFFFF).to(torch.float32) * (1.0 / (1 << 24))


def permute(positions: torch.Tensor, total: int, seed: int, epoch: int) -> torch.Tensor:
    """The seeded bijection of [0, total) applied to int64 ``positions`` (any shape).

    A 4-round Feistel network on the smallest even bit width covering ``total``, cycle
    walking back into range (the domain is < 4 * total, so a few rounds at most). Runs on
    ``positions``' device; a CPU tensor costs no device synchronisation.
    """
    if total > 1 << 62:
        raise ValueError(f"total={total}: at most 2^62 samples")
    half = max(1, math.ceil(math.log2(max(total, 2)) / 2))
    mask = (1 << half) - 1
    keys = [int(hash_ints(seed, epoch, _ORDER, r)) for r in range(4)]

    def feistel(x: torch.Tensor) -> torch.Tensor:
        left, right = x >> half, x & mask
        for key in keys:
            f = mix32(right.to(torch.int32) + _i32(key)).to(torch.int64) & mask
            left, right = right, left ^ f
        return (left << half) | right

    x = feistel(positions)
    while bool((out := x >= total).any()):
        x = torch.where(out, feistel(x), x)
    return x


def _bicubic_rows(device: torch.device) -> torch.Tensor:
    """``[CANVAS, GRID]``: canvas row i = this matrix @ the grid's rows, i.e. exactly
    ``F.interpolate(grid, (CANVAS, CANVAS), mode="bicubic", align_corners=False)`` along one
    axis (bicubic is separable), so a crop of the canvas is two small batched matmuls."""
    basis = torch.eye(GRID, device=device).view(GRID, 1, GRID, 1).expand(GRID, 1, GRID, GRID)
    up = F.interpolate(basis.contiguous(), size=(CANVAS, CANVAS), mode="bicubic",
                       align_corners=False)
    return up[:, 0, :, 0].T.contiguous()


def render(labels: torch.Tensor, images: torch.Tensor, seed: int,
           flip: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Images ``image`` of identities ``labels`` (int64 ``[N]`` each, on the target device):
    uint8 ``[N, 3, 112, 112]``, a pure function of (seed, label, image); ``flip`` (bool
    ``[N]``) mirrors them horizontally. ``rows``: :func:`_bicubic_rows` (cached by callers)."""
    device = labels.device
    rows = _bicubic_rows(device) if rows is None else rows
    n = labels.shape[0]
    # Per class: grid colours, disc centre, radius and colour (as data_pipeline.synthetic).
    p = uniform(hash_ints(seed, _CLASS, labels[:, None],
                          torch.arange(_CLASS_PARAMS, device=device)))
    grid = (p[:, :48] * 256.0).view(n, 3, GRID, GRID)
    centre = (0.25 + 0.5 * p[:, 48:50]) * CANVAS
    radius = (0.12 + 0.13 * p[:, 50]) * CANVAS
    disc_colour = torch.floor(p[:, 51:54] * 256.0)
    # Per image: crop offset in [0, 16] (y, x) and brightness gain.
    q = uniform(hash_ints(seed, _IMAGE, labels[:, None], images[:, None],
                          torch.arange(3, device=device)))
    offset = torch.floor(q[:, :2] * (CANVAS - SIZE + 1)).long()
    span = torch.arange(SIZE, device=device)
    ys, xs = offset[:, :1] + span, offset[:, 1:] + span  # [N, 112] canvas coordinates
    crop = rows[ys][:, None] @ grid @ rows[xs].transpose(1, 2)[:, None]  # [N, 3, 112, 112]
    dy = (ys.float() - centre[:, :1])[:, :, None]
    dx = (xs.float() - centre[:, 1:])[:, None, :]
    disc = (dy**2 + dx**2 <= (radius**2)[:, None, None])[:, None]
    crop = torch.where(disc, disc_colour[:, :, None, None], crop)
    gain = 0.75 + 0.5 * q[:, 2]
    crop = crop * gain[:, None, None, None] + NOISE_SIGMA * _normal(labels, images, seed)
    if flip is not None:
        crop = torch.where(flip[:, None, None, None], crop.flip(-1), crop)
    return crop.round_().clamp_(0, 255).to(torch.uint8)


def _normal(labels: torch.Tensor, images: torch.Tensor, seed: int) -> torch.Tensor:
    """Pixel noise ``[N, 3, 112, 112]`` of mean 0 and variance 1 per (seed, label, image):
    the sum of the four bytes of one hash per pixel, standardised (Irwin-Hall: close to a
    Gaussian, bounded at +-3.46; a third of Box-Muller's cost on a CPU)."""
    key = hash_ints(seed, _NOISE, labels, images)
    pixel = torch.arange(3 * SIZE * SIZE, device=labels.device, dtype=torch.int32)
    h = mix32(key[:, None] + pixel)
    total = (h & 255) + ((h >> 8) & 255) + ((h >> 16) & 255) + ((h >> 24) & 255)
    return ((total.to(torch.float32) - 510.0) * (1.0 / _BYTES4_STD)).view(-1, 3, SIZE, SIZE)


class SyntheticStream(EpochBatches):
    """``classes * images_per_class`` synthetic samples per epoch as loader batches (see the
    module docstring): an iterable over (images uint8 ``[B, 3, 112, 112]``, labels int64
    ``[B]``[, keys ``"label/image"``]) on ``device``.

    rank/world_size: this process's data-parallel position; batch_size is per rank.
    """

    def __init__(self, num_classes: int, images_per_class: int, *, batch_size: int,
                 rank: int = 0, world_size: int = 1, seed: int = 0, epoch: int = 0,
                 flip: bool = True, with_keys: bool = False,
                 device: torch.device | str = "cpu"):
        if min(num_classes, images_per_class, batch_size, world_size) < 1:
            raise ValueError(f"num_classes={num_classes}, images_per_class={images_per_class},"
                             f" batch_size={batch_size}, world_size={world_size}: all must "
                             "be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} outside [0, world_size={world_size})")
        if num_classes >= 1 << 31 or images_per_class >= 1 << 31:
            raise ValueError(f"num_classes={num_classes}, images_per_class={images_per_class}:"
                             " each must be < 2^31")
        self.num_classes, self.images_per_class = num_classes, images_per_class
        self.num_samples = num_classes * images_per_class
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.flip, self.with_keys = seed, flip, with_keys
        self.device = torch.device(device)
        self._len = self.num_samples // (batch_size * world_size)
        if self._len == 0:
            raise DataError(f"synthetic data: {self.num_samples} samples cannot fill one "
                            f"batch of {batch_size} on each of {world_size} ranks")
        self.dropped_fraction = 1.0 - self._len * batch_size * world_size / self.num_samples
        self.epoch = epoch
        self._batches = 0
        self.num_skipped = 0  # nothing is ever corrupt or padded; the trainer reads both
        self.num_padded = 0
        self._rows = _bicubic_rows(self.device)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a new one starts at its first batch, the current one keeps its
        position (so set_epoch after load_state_dict resumes mid-epoch)."""
        if epoch != self.epoch:
            self.epoch, self._batches = epoch, 0

    def plan_key(self) -> SyntheticPlan:
        """Everything that fixes which samples global batch b holds (saved with the position)."""
        return SyntheticPlan(seed=self.seed, num_samples=self.num_samples,
                             num_classes=self.num_classes,
                             global_batch=self.batch_size * self.world_size)

    def position(self) -> SyntheticPosition:
        return SyntheticPosition(epoch=self.epoch, batches=self._batches, rank=self.rank,
                                 plan=self.plan_key())

    def load_state_dict(self, state: dict) -> None:
        self.restore(SyntheticPosition.from_dict(state))

    def restore(self, position: SyntheticPosition) -> None:
        """Go back to ``position``. Same plan (seed, classes, images per class and global
        batch ``batch_size * world_size``, whatever the split into ranks): exact. Another
        global batch: resumes at the first global batch after the samples consumed (up to one
        global batch of the epoch is skipped, none repeated). Another data set (a position
        saved by the shard loader, other classes): at the same fraction of the epoch."""
        old, new, batches = position.plan, self.plan_key(), position.batches
        if old == new:
            done = batches
        elif isinstance(old, SyntheticPlan) and (old.seed, old.num_samples, old.num_classes) \
                == (new.seed, new.num_samples, new.num_classes):
            done = math.ceil(batches * old.global_batch / new.global_batch)
        else:
            old_len = old.batches_per_rank
            done = math.ceil(min(1.0, batches / old_len) * self._len) if old_len else 0
        self.epoch, self._batches = position.epoch, min(self._len, done)

    def indices(self, batch: int) -> torch.Tensor:
        """Sample indices (int64 ``[B]``, CPU) of this rank's batch ``batch`` of the epoch."""
        start = batch * self.batch_size * self.world_size + self.rank * self.batch_size
        positions = torch.arange(start, start + self.batch_size, dtype=torch.int64)
        return permute(positions, self.num_samples, self.seed, self.epoch)

    def batch(self, batch: int) -> tuple:
        """This rank's batch ``batch`` of the current epoch (a pure function of it)."""
        index = self.indices(batch)
        if self.device.type == "cuda":  # page-locked: the copy does not wait for the GPU
            index = index.pin_memory()
        index = index.to(self.device, non_blocking=True)
        flip = uniform(hash_ints(self.seed, _FLIP, self.epoch, index)) < (0.5 if self.flip else 0)
        labels, images = index // self.images_per_class, index % self.images_per_class
        out = (render(labels, images, self.seed, flip, self._rows), labels)
        if self.with_keys:
            keys = [f"{c}/{i}" for c, i in zip(labels.tolist(), images.tolist(), strict=True)]
            out = (*out, keys)
        return out

    def __iter__(self):
        if self._batches >= self._len:  # a finished epoch iterates again from its start
            self._batches = 0
        while self._batches < self._len:
            out = self.batch(self._batches)
            self._batches += 1
            yield out
