"""Data cleaning with sub-centers (Deng et al., ECCV 2020, Sec. 3.2): after training with
``margin.subcenters=K``, each class's clean images gather on one centre, the dominant one;
noisy images (another identity under this label) sit on the others or far from all. The
paper drops the samples whose angle to their class's dominant centre exceeds 75 degrees.

Here: every sample's embedding (``trainer.evaluation.embed_images``: flip-summed, unit) is
compared with its own class's ``K`` centres (the head's rows, normalised); its nearest centre
votes for the class's dominant one, and its ``K`` cosines are kept (``K`` floats per sample,
not the embedding). After the stream the votes ``[C, K]`` are summed over the ranks, the
dominant centre is each class's most voted (ties: the lowest index), and a sample is listed
when ``acos(cos(x, dominant))`` exceeds the threshold.

Work is spread over the ranks of ``process_group`` (None: WORLD, or one process): rank ``r``
streams the shards ``r, r + P, ...`` once; one all-reduce of the votes and one all-gather of
the listed keys; every rank returns the same result, equal to one process's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from data_pipeline.manifest import read_manifest
from offline.folder_scan import labelled_batches
from partial_fc.distributed import all_reduce, get_rank, get_world_size
from trainer.evaluation import embed_images, eval_mode

DEFAULT_THRESHOLD = 75.0  # degrees, the paper's


@dataclass(frozen=True)
class Cleaning:
    """The outcome: ``noisy`` the listed sample keys; ``samples`` the decodable samples seen;
    ``dominant_share`` the share of them nearest their class's dominant centre."""

    noisy: frozenset[str]
    samples: int
    dominant_share: float


def head_centres(weight: torch.Tensor, num_classes: int) -> torch.Tensor:
    """The head's rows ``[K * C, D]`` (class-major, ``partial_fc.subcenters``) as unit
    centres ``[C, K, D]`` fp32."""
    rows, dim = weight.shape
    if rows % num_classes:
        raise ValueError(f"head weight {tuple(weight.shape)}: not K rows for each of "
                         f"{num_classes} classes")
    return F.normalize(weight.float().view(num_classes, rows // num_classes, dim), dim=2)


@torch.no_grad()
def find_noisy(backbone: nn.Module, centres: torch.Tensor, data_dir: str | Path,
               threshold_deg: float = DEFAULT_THRESHOLD, batch_size: int = 128,
               device: torch.device | str = "cpu", process_group=None,
               progress: bool = False) -> Cleaning:
    """The samples of ``data_dir`` farther than ``threshold_deg`` from their class's dominant
    centre, ``centres`` ``[C, K, D]`` unit (:func:`head_centres`). Collective over
    ``process_group``; every rank returns the same value."""
    rank, world = get_rank(process_group), get_world_size(process_group)
    num_classes, k, _ = centres.shape
    manifest = read_manifest(data_dir)
    if manifest.num_classes != num_classes:
        raise ValueError(f"{data_dir}: {manifest.num_classes} classes in manifest.json, the "
                         f"checkpoint's head has {num_classes}: not the data it was trained on")
    centres = centres.to(device)
    votes = torch.zeros(num_classes, k, dtype=torch.float64, device=device)
    keys, labels, cosines = [], [], []
    with eval_mode(backbone):
        for batch_keys, y, images in labelled_batches(
                data_dir, batch_size, rank, world, "launch.clean" if progress else None):
            y = torch.from_numpy(y).to(device)
            emb = embed_images(backbone, images, batch_size, device)  # [B, D] unit
            cos = torch.einsum("bd,bkd->bk", emb, centres[y])  # [B, K]
            votes.index_put_((y, cos.argmax(dim=1)), torch.ones(len(y), dtype=torch.float64,
                                                                device=device), accumulate=True)
            keys += batch_keys
            labels.append(y)
            cosines.append(cos)
    votes = all_reduce(votes, process_group)
    dominant = votes.argmax(dim=1)  # [C]
    total = votes.sum()
    share = float(votes.amax(dim=1).sum() / total) if total > 0 else math.nan
    noisy: list[str] = []
    if keys:
        y, cos = torch.cat(labels), torch.cat(cosines)
        to_dominant = cos.gather(1, dominant[y][:, None]).squeeze(1).clamp(-1.0, 1.0)
        far = torch.rad2deg(torch.acos(to_dominant)) > threshold_deg
        noisy = [key for key, bad in zip(keys, far.tolist(), strict=True) if bad]
    if world > 1:
        every: list = [None] * world
        dist.all_gather_object(every, noisy, group=process_group)
        noisy = [key for part in every for key in part]
    return Cleaning(frozenset(noisy), int(total.item()), share)
