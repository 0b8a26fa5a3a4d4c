"""The training folder as the overlap's search sees it: one centre per identity.

Each training identity ``c`` gets a centre ``mu_c = normalize(mean_i normalize(f(x_i)))`` over
its images (the embeddings are those of evaluation: flip-summed, unit length,
``trainer.evaluation.embed_images``). A centre is a steadier template than any one image (the
same test as the template pooling of IJB, arXiv 1710.08092's mean feature), so one threshold
serves every set searched against the centres; the images that calibrate it (the null probes,
``offline.overlap.calibration.NullChoice``) are kept in the same pass over the shards, and
searched against the other identities' centres by :func:`null_cosines`.

Work is spread over the ranks of ``process_group`` (None: WORLD, or one process): rank ``r``
decodes the shards ``r, r + P, ...``; the class sums and counts ``[C, D]``, ``[C]`` are
all-reduced, so every rank holds every centre (on the CPU, where faiss searches them). One
process and P ranks give the same centres (up to the summation order).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from data_pipeline.errors import DataError
from data_pipeline.manifest import read_manifest
from offline.folder_scan import labelled_batches
from offline.overlap.calibration import NullChoice
from offline.overlap.search import best_other_centre
from partial_fc.distributed import all_gather, all_reduce, get_rank, get_world_size
from trainer.evaluation import embed_images, eval_mode


@dataclass(frozen=True)
class TrainingCentres:
    """The training folder as the search sees it: unit ``centres`` ``[C, D]`` float32 (a
    class without a decodable image: a zero row), ``counts`` ``[C]``, and this rank's null
    probes (embeddings ``[n_r, D]``, labels ``[n_r]``; :class:`NullChoice`)."""

    centres: np.ndarray
    counts: np.ndarray
    null_probes: np.ndarray
    null_labels: np.ndarray


@torch.no_grad()
def class_centres(backbone: nn.Module, data_dir: str | Path, batch_size: int,
                  device: torch.device | str, process_group=None,
                  null: NullChoice | None = None) -> TrainingCentres:
    """The centres of every class of the shard folder (a path or a URL), and the embeddings
    of the images ``null`` chooses (None: none), kept in the same pass. Collective over
    ``process_group``; shards ``rank::world`` are read here, every rank returns every centre."""
    rank, world = get_rank(process_group), get_world_size(process_group)
    manifest = read_manifest(data_dir)
    num_classes = manifest.num_classes
    if num_classes > manifest.num_samples:  # before [C, D] centres are sized by the claim
        raise DataError(f"{data_dir}: manifest.json states {num_classes} classes for "
                        f"{manifest.num_samples} samples; a converted class holds one at least")
    with eval_mode(backbone):
        dim = embed_images(backbone, np.zeros((1, 3, 112, 112), np.uint8), 1, device).shape[1]
        sums = torch.zeros(num_classes, dim, device=device)
        counts = torch.zeros(num_classes, device=device)
        probes, probe_labels = [np.zeros((0, dim), np.float32)], [np.zeros(0, np.int64)]
        for keys, labels, images in labelled_batches(data_dir, batch_size, rank, world):
            idx = torch.from_numpy(labels).to(device)
            emb = embed_images(backbone, images, batch_size, device)
            sums.index_add_(0, idx, emb)
            counts.index_add_(0, idx, torch.ones(len(idx), device=device))
            chosen = [i for i, (k, c) in enumerate(zip(keys, labels, strict=True))
                      if null is not None and null.takes(k, int(c))]
            if chosen:
                probes.append(emb[chosen].cpu().numpy())
                probe_labels.append(labels[chosen])
    sums, counts = all_reduce(sums, process_group), all_reduce(counts, process_group)
    return TrainingCentres(nn.functional.normalize(sums, dim=1).cpu().numpy(),
                           counts.cpu().numpy(), np.concatenate(probes),
                           np.concatenate(probe_labels))


def null_cosines(trained: TrainingCentres, device: torch.device | str,
                 process_group=None) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's null probes searched against the other identities' centres
    (``best_other_centre``), gathered: the cosines ``[n]`` float64, sorted, and their probes'
    labels ``[n]`` (``calibrate`` counts the identities), the same on every rank."""
    mine = best_other_centre(trained.null_probes, trained.null_labels, trained.centres)
    every = all_gather(torch.from_numpy(mine.astype(np.float64)).to(device), process_group)
    labels = all_gather(torch.from_numpy(trained.null_labels).to(device), process_group)
    every, labels = every.cpu().numpy(), labels.cpu().numpy()
    order = np.lexsort((labels, every))
    return every[order], labels[order]
