"""Train/test identity overlap: which training identities also appear in the evaluation sets.

Each training identity ``c`` gets a centre ``mu_c = normalize(mean_i normalize(f(x_i)))`` over
its images (the embeddings are those of evaluation: flip-summed, unit length,
``trainer.evaluation.embed_images``). An evaluation image ``y`` matches ``c`` when
``cos(mu_c, f(y)) >= threshold``; ``c`` is shared with a set when any image of the set matches
it. A centre is a steadier template than any one image (the same test as the template
pooling of IJB, arXiv 1710.08092's mean feature), so one threshold serves every set.

Work is spread over the ranks of ``process_group`` (None: WORLD, or one process): rank ``r``
decodes the shards ``r, r + P, ...`` and the evaluation images ``r, r + P, ...``; the class
sums and counts ``[C, D]``, ``[C]`` are all-reduced, so every rank holds every centre, and
the matches are all-reduced too. One process and P ranks give the same answer (up to the
summation order of the centres).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from data_pipeline.codec import resolve_decoder
from data_pipeline.manifest import read_manifest
from offline.folder_scan import batched, decoded, labelled_batches
from partial_fc.distributed import all_reduce, get_rank, get_world_size
from trainer.evaluation import embed_images, eval_mode

DEFAULT_THRESHOLD = 0.5  # cosine, without a .bin to calibrate from
DEFAULT_FMR = 1e-3  # the false-match rate of the .bins' impostor pairs the threshold is set at


@dataclass(frozen=True)
class SetOverlap:
    """What one evaluation set shares with the training data."""

    name: str
    images: int  # images in the set (distinct)
    matched_images: int  # its images within the threshold of some training centre
    classes: frozenset[int]  # training labels with a centre within the threshold of an image


@torch.no_grad()
def class_centres(backbone: nn.Module, data_dir: str | Path, batch_size: int,
                  device: torch.device | str, process_group=None) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """Unit centres ``[C, D]`` (float32, on ``device``) of every class of the shard folder
    and each class's image count ``[C]`` (a class without a decodable image: a zero row).
    Collective over ``process_group``; shards ``rank::world`` are read here."""
    rank, world = get_rank(process_group), get_world_size(process_group)
    num_classes = read_manifest(data_dir).num_classes
    with eval_mode(backbone):
        dim = embed_images(backbone, np.zeros((1, 3, 112, 112), np.uint8), 1, device).shape[1]
        sums = torch.zeros(num_classes, dim, device=device)
        counts = torch.zeros(num_classes, device=device)
        for _, labels, images in labelled_batches(data_dir, batch_size, rank, world):
            idx = torch.from_numpy(labels).to(device)
            sums.index_add_(0, idx, embed_images(backbone, images, batch_size, device))
            counts.index_add_(0, idx, torch.ones(len(idx), device=device))
    sums, counts = all_reduce(sums, process_group), all_reduce(counts, process_group)
    return nn.functional.normalize(sums, dim=1), counts


@torch.no_grad()
def set_overlap(name: str, images: Callable[[int, int], Iterator[np.ndarray]], count: int,
                backbone: nn.Module, centres: torch.Tensor, threshold: float, batch_size: int,
                device: torch.device | str, process_group=None) -> SetOverlap:
    """Match one evaluation set against ``centres``. ``images(rank, world)`` yields this
    rank's share of the set, uint8 ``[B, 3, 112, 112]`` batches; ``count`` is the set's size.
    Collective over ``process_group``; every rank returns the same value."""
    rank, world = get_rank(process_group), get_world_size(process_group)
    hit = torch.zeros(len(centres), device=device)
    matched = torch.zeros(1, device=device)
    with eval_mode(backbone):
        for batch in images(rank, world):
            sims = embed_images(backbone, batch, batch_size, device) @ centres.T  # [B, C]
            close = sims >= threshold
            hit += close.any(0)
            matched += close.any(1).sum()
    hit, matched = all_reduce(hit, process_group), all_reduce(matched, process_group)
    classes = frozenset(torch.nonzero(hit).flatten().tolist())
    return SetOverlap(name, count, int(matched.item()), classes)


def bin_images(encoded: list[bytes], batch_size: int) -> Callable[[int, int], Iterator]:
    """A ``.bin``'s images (give them distinct) as :func:`set_overlap`'s per-rank source."""

    def share(rank: int, world: int) -> Iterator[np.ndarray]:
        items = decoded(enumerate(encoded[rank::world]), resolve_decoder("auto"))
        return (images for _, images in batched(items, batch_size))

    return share


def ijb_images(meta, batch_size: int) -> Callable[[int, int], Iterator]:
    """IJB-B/C's aligned faces (``data_pipeline.ijb``) as :func:`set_overlap`'s source: rank
    ``r`` takes the batches ``r, r + P, ...``."""
    from data_pipeline.ijb import iter_aligned_faces

    def share(rank: int, world: int) -> Iterator[np.ndarray]:
        for i, batch in enumerate(iter_aligned_faces(meta, batch_size)):
            if i % world == rank:
                yield batch

    return share


@torch.no_grad()
def impostor_cosines(backbone: nn.Module, encoded: list[bytes], issame: list[bool],
                     batch_size: int, device: torch.device | str) -> np.ndarray:
    """The cosines of a ``.bin``'s impostor pairs (images ``2i``, ``2i + 1`` where
    ``issame[i]`` is False) under ``backbone``; a pair with an undecodable image is left out.
    Every rank computes them all (a .bin is a few thousand pairs)."""
    wanted = [i for i, same in enumerate(issame) if not same]
    blobs = ((2 * i + k, encoded[2 * i + k]) for i in wanted for k in (0, 1))
    emb: dict[int, torch.Tensor] = {}
    with eval_mode(backbone):
        for tags, images in batched(decoded(blobs, resolve_decoder("auto")), batch_size):
            emb.update(zip(tags, embed_images(backbone, images, batch_size, device).cpu(),
                           strict=True))
    return np.array([float(emb[2 * i] @ emb[2 * i + 1]) for i in wanted
                     if 2 * i in emb and 2 * i + 1 in emb])


def calibrated_threshold(cosines: np.ndarray, fmr: float) -> float:
    """The smallest cosine that at most a share ``fmr`` of the impostor ``cosines`` reach
    (their ``1 - fmr`` quantile, taken upward): at it, an image and a centre of different
    identities are listed about as often as two impostor images would match."""
    return float(np.quantile(cosines, 1.0 - fmr, method="higher"))
