"""Train/test identity overlap: which training identities also appear in the evaluation sets.

Each evaluation image ``y`` is searched against every training centre ``mu_c``
(``offline.overlap.centres``; open-set identification, ``offline.overlap.search``); its
nearest centre's identity is listed when ``max_c cos(mu_c, f(y)) >= threshold``, the
threshold calibrated for that search (``offline.overlap.calibration``).

Work is spread over the ranks of ``process_group`` (None: WORLD, or one process): rank ``r``
embeds the evaluation images ``r, r + P, ...`` and each image's nearest centre is
all-reduced. One process and P ranks give the same answer (up to the summation order of the
centres).

Each shared identity is reported with the evidence a person checks: the set's image nearest
its centre, and the identity's training image nearest that one (its shard key and the source
path the converter stored), found by a second pass over the shards that decodes only the
shared identities' images (:func:`nearest_samples`); :func:`overlap_rows` joins them with the
identity names of the folder's map (data_pipeline.identities).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from data_pipeline.codec import resolve_decoder
from offline.folder_scan import batched, decoded, labelled_samples
from offline.overlap.eval_sets import EvalImages
from offline.overlap.search import SEARCH_BLOCK, centre_search
from partial_fc.distributed import all_reduce_max, get_rank, get_world_size
from trainer.evaluation import embed_images, eval_mode


@dataclass(frozen=True)
class Match:
    """A training identity an evaluation set shares: ``label``, the set's image nearest its
    centre (``image``, an index into the set's names) and their cosine ``score``."""

    label: int
    score: float
    image: int


@dataclass(frozen=True)
class SetOverlap:
    """What one evaluation set shares with the training data; ``best`` ``[images]`` is each
    image's nearest-centre cosine (NaN: undecodable), the search's histogram."""

    name: str
    images: int  # images in the set (distinct)
    matched_images: int  # its images within the threshold of some training centre
    matches: tuple[Match, ...]  # one per shared training identity, by label
    best: np.ndarray = field(compare=False, repr=False)

    @property
    def classes(self) -> frozenset[int]:
        """The training labels nearest an image of the set, within the threshold."""
        return frozenset(m.label for m in self.matches)


@dataclass(frozen=True)
class NearestImage:
    """The training image of an identity nearest a matched evaluation image: its shard
    ``key``, the ``source`` path the converter stored (None in shards without one) and the
    cosine ``score``."""

    key: str
    source: str | None
    score: float


@torch.no_grad()
def set_overlap(images: EvalImages, backbone: nn.Module, centres: np.ndarray,
                threshold: float, batch_size: int, device: torch.device | str,
                process_group=None) -> SetOverlap:
    """Search one evaluation set against ``centres`` ``[C, D]``: each rank embeds its share
    (``images.share``) in blocks of :data:`SEARCH_BLOCK` and finds each image's nearest
    centre. An image within ``threshold`` lists its nearest identity; each listed identity's
    match is its image of highest cosine (the lowest index among equal ones). Collective
    over ``process_group``; every rank returns the same value."""
    rank, world = get_rank(process_group), get_world_size(process_group)
    best = torch.full((len(images.names),), -torch.inf, dtype=torch.float64, device=device)
    nearest = torch.full((len(images.names),), -1, dtype=torch.int64, device=device)
    with eval_mode(backbone):
        for indices, batch in images.share(rank, world, max(batch_size, SEARCH_BLOCK)):
            emb = embed_images(backbone, batch, batch_size, device).cpu().numpy()
            scores, labels = centre_search(emb, centres)
            at = torch.tensor(indices, device=device)
            best[at] = torch.from_numpy(scores[:, 0].astype(np.float64)).to(device)
            nearest[at] = torch.from_numpy(labels[:, 0]).to(device)
    best = all_reduce_max(best, process_group).cpu().numpy()  # each image is one rank's
    nearest = all_reduce_max(nearest, process_group).cpu().numpy()
    listed = np.flatnonzero(best >= threshold)
    order = listed[np.lexsort((listed, -best[listed], nearest[listed]))]  # label, best first
    firsts = order[np.r_[True, nearest[order][1:] != nearest[order][:-1]]] if len(order) else []
    return SetOverlap(images.name, len(images.names), len(listed),
                      tuple(Match(int(nearest[i]), float(best[i]), int(i)) for i in firsts),
                      np.where(np.isfinite(best), best, np.nan))


@torch.no_grad()
def nearest_samples(backbone: nn.Module, data_dir: str | Path,
                    queries: list[tuple[int, EvalImages, int]], batch_size: int,
                    device: torch.device | str, process_group=None) -> list[NearestImage | None]:
    """For each query ``(label, set, image)``: the training image of ``label`` nearest that
    evaluation image (None where the class has no decodable image). A second pass over the
    shards ``rank::world`` that decodes only the queried classes' images. Collective over
    ``process_group``; every rank returns the same list."""
    rank, world = get_rank(process_group), get_world_size(process_group)
    if not queries:
        return []
    with eval_mode(backbone):
        targets = _query_embeddings(backbone, queries, batch_size, device)  # [Q, D]
        owner = torch.tensor([label for label, _, _ in queries], device=device)
        found: list[tuple[float, str, str | None] | None] = [None] * len(queries)
        wanted = frozenset(owner.tolist())
        tagged = (((s["__key__"], label, _text(s.get("src"))), s["jpg"])
                  for label, s in labelled_samples(data_dir, rank, world,
                                                   exts=("jpg", "cls", "src"))
                  if label in wanted)
        for tags, batch in batched(decoded(tagged, resolve_decoder("auto")), batch_size):
            labels = torch.tensor([label for _, label, _ in tags], device=device)
            sims = embed_images(backbone, batch, batch_size, device) @ targets.T  # [B, Q]
            sims = sims.masked_fill(labels[:, None] != owner[None, :], -torch.inf)
            top, row = (t.cpu() for t in sims.max(0))
            for q in torch.nonzero(top > -torch.inf).flatten().tolist():
                key, _, source = tags[row[q]]
                candidate = (float(top[q]), key, source)
                if found[q] is None or _better(candidate, found[q]):
                    found[q] = candidate
    if world > 1:
        every: list = [None] * world
        dist.all_gather_object(every, found, group=process_group)
        found = [None] * len(queries)
        for theirs in every:
            found = [b if a is None or (b is not None and _better(b, a)) else a
                     for a, b in zip(found, theirs, strict=True)]
    return [None if f is None else NearestImage(f[1], f[2], f[0]) for f in found]


def _better(a: tuple[float, str, str | None], b: tuple[float, str, str | None]) -> bool:
    """Higher cosine first, then the smaller key (the same choice on any number of ranks)."""
    return a[0] > b[0] or (a[0] == b[0] and a[1] < b[1])


def _text(member: bytes | None) -> str | None:
    return None if member is None else bytes(member).decode("utf-8", "replace")


def _query_embeddings(backbone: nn.Module, queries: list[tuple[int, EvalImages, int]],
                      batch_size: int, device: torch.device | str) -> torch.Tensor:
    """The embeddings ``[Q, D]`` of the queries' evaluation images (each decodable: it
    matched), a set's images embedded together."""
    rows: dict[tuple[str, int], torch.Tensor] = {}
    for images in {id(q[1]): q[1] for q in queries}.values():
        indices = sorted({image for _, s, image in queries if s is images})
        for found, batch in images.batches(indices, batch_size):
            emb = embed_images(backbone, batch, batch_size, device)
            rows.update({(images.name, i): e for i, e in zip(found, emb, strict=True)})
    return torch.stack([rows[(images.name, image)] for _, images, image in queries])


def overlap_rows(sets: list[EvalImages], results: list[SetOverlap],
                 names: tuple[str, ...] | None, nearest: list[NearestImage | None]) -> list[dict]:
    """One JSON-able row per (set, shared identity), in :func:`queries` order: ``set``,
    ``label``, ``identity`` (from the folder's map; None without one), ``score`` (centre to
    image cosine), ``image`` (its name in the set), and the nearest training image's ``key``,
    ``source`` and ``sample_score`` (None where it has none)."""
    rows, near_of = [], iter(nearest)
    for images, result in zip(sets, results, strict=True):
        for match in result.matches:
            near = next(near_of)
            rows.append({"set": images.name, "label": match.label,
                         "identity": None if names is None else names[match.label],
                         "score": round(match.score, 6), "image": images.names[match.image],
                         "key": near and near.key, "source": near and near.source,
                         "sample_score": near and round(near.score, 6)})
    return rows


def queries(sets: list[EvalImages], results: list[SetOverlap]) -> list[tuple[int, EvalImages,
                                                                              int]]:
    """``(label, set, image)`` of every match, set by set: :func:`nearest_samples`' input."""
    return [(m.label, images, m.image)
            for images, result in zip(sets, results, strict=True) for m in result.matches]
