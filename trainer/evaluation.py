"""Embed images with a backbone and score verification sets (``.bin``: 10-fold accuracy,
AUC, TAR@FAR), IJB-B/C 1:1 and 1:N templates, RFW by group, TinyFace's and MegaFace's
rank-k; shared by ``launch.evaluate`` and training.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from data_pipeline.codec import decode_image, read_image_file, resolve_decoder
from data_pipeline.errors import DataError
from data_pipeline.ijb import iter_aligned_faces, read_ijb_1n_meta, read_ijb_meta
from data_pipeline.megaface import read_megaface
from data_pipeline.rfw import find_rfw_bin, read_rfw_pairs, rfw_image_root
from data_pipeline.tinyface import ALIGNED_DIR, read_tinyface
from data_pipeline.verification_bin import read_bin
from partial_fc.backbones import normalize_images
from partial_fc.distributed import all_gather, get_rank, get_world_size
from partial_fc.eval.fairness import RFW_GROUPS, THRESHOLD_RULES, group_summary, tface_accuracy
from partial_fc.eval.gallery_search import top_k_search
from partial_fc.eval.ijb import evaluate_ijb, template_features
from partial_fc.eval.ijb_1n import identification
from partial_fc.eval.megaface import MEGAFACE_SIZES, clean_probe_features, megaface_identification
from partial_fc.eval.ranking import TINYFACE_RANKS, cmc
from partial_fc.eval.verification import evaluate_pairs


@contextlib.contextmanager
def eval_mode(backbone: nn.Module):
    """``backbone`` in eval mode for the block; its train/eval mode is restored after."""
    was_training = backbone.training
    backbone.eval()
    try:
        yield
    finally:
        backbone.train(was_training)


@torch.no_grad()
def embed_images(backbone: nn.Module, images: np.ndarray | torch.Tensor, batch_size: int,
                 device: torch.device | str, normalise: bool = True) -> torch.Tensor:
    """uint8 ``[N, 3, 112, 112]`` -> float32 ``[N, D]`` on ``device``.

    Each embedding is ``f(x) + f(flip(x))`` (horizontal flip), L2-normalised unless
    ``normalise=False`` (IJB keeps the norm as a quality weight): the convention
    insightface's numbers use. The backbone must already be in eval mode, on
    ``device``; inputs are cast to its parameter dtype.
    """
    dtype = next(backbone.parameters()).dtype
    out = []
    for start in range(0, len(images), batch_size):
        x = torch.as_tensor(images[start:start + batch_size]).to(device)
        x = normalize_images(x).to(dtype)
        emb = backbone(x).float() + backbone(torch.flip(x, dims=[3])).float()
        out.append(nn.functional.normalize(emb, dim=1) if normalise else emb)
    return torch.cat(out)


def embed_shared(backbone: nn.Module, encoded: Sequence[bytes], batch_size: int,
                 device: torch.device | str, process_group=None) -> torch.Tensor:
    """Embed encoded images, each rank its contiguous share; every rank returns all ``[N, D]``.

    Called by every rank of ``process_group`` (None: WORLD, or one process when
    torch.distributed is not initialised). Shares are padded to equal length by
    repeating the last image, so every rank runs the same batches and the gather is even;
    the padding is dropped.
    """
    rank, world = get_rank(process_group), get_world_size(process_group)
    n = len(encoded)
    chunk = math.ceil(n / world)
    share = [encoded[min(i, n - 1)] for i in range(rank * chunk, (rank + 1) * chunk)]
    decoder = resolve_decoder("auto")
    images = np.stack([decode_image(b, 112, decoder).transpose(2, 0, 1) for b in share])
    local = embed_images(backbone, images, batch_size, device)
    return all_gather(local, process_group, sizes=[chunk] * world)[:n]


def evaluate_bins(
    backbone: nn.Module, bin_paths: Sequence[str | Path], batch_size: int,
    device: torch.device | str, process_group=None,
) -> dict[str, dict[str, float | int]]:
    """Verification metrics of ``backbone`` on insightface ``.bin`` sets.

    Called by every rank of ``process_group``; each rank embeds its share of the
    images and all ranks return the same dict ``{bin stem: evaluate_pairs(...)}``
    (keys: accuracy, accuracy_std, best_threshold, auc, tar@far=..., and the integers
    num_pairs and impostor_pairs).
    Pass the bare backbone (not a DDP/DeepSpeed wrapper); its train/eval mode is
    restored on return.
    """
    names = [Path(p).stem for p in bin_paths]
    if len(set(names)) != len(names):
        raise ValueError(f"verification sets need distinct file names, got {list(bin_paths)}")
    results = {}
    with eval_mode(backbone):
        for name, path in zip(names, bin_paths, strict=True):
            emb, issame = _bin_embeddings(backbone, path, batch_size, device, process_group)
            results[name] = evaluate_pairs(emb[0::2], emb[1::2], issame)
    return results


def _bin_embeddings(backbone: nn.Module, path: str | Path, batch_size: int,
                    device: torch.device | str, process_group=None) -> tuple[np.ndarray, list]:
    """``[2P, D]`` unit features of a ``.bin`` set's images (pairs interleaved) and its
    ``issame``; every rank of ``process_group`` calls it."""
    encoded, issame = read_bin(path)
    # A face appears in several pairs (ORL's 1,800 entries hold 100 images): embed each
    # distinct image once and index.
    unique = {image: i for i, image in enumerate(dict.fromkeys(encoded))}
    emb = embed_shared(backbone, list(unique), batch_size, device, process_group)
    return emb.cpu()[torch.tensor([unique[image] for image in encoded])].numpy(), issame


def evaluate_rfw_dir(backbone: nn.Module, root: str | Path, batch_size: int,
                     device: torch.device | str, rule: str = "tface",
                     process_group=None) -> dict[str, dict[str, float | int | str]]:
    """RFW accuracy per group and their spread (``partial_fc.eval.fairness``).

    ``root`` holds one ``.bin`` per group (every rank of ``process_group`` calls it and
    embeds its share, as :func:`evaluate_bins`) or the released folder of images and
    ``<group>_pairs.txt`` lists (``data_pipeline.rfw``; one process). Each group's row is
    :func:`evaluate_pairs`' metrics, its accuracy (and threshold) replaced by TFace's
    :func:`tface_accuracy` under ``rule="tface"``; the row ``RFW`` summarises them.
    """
    if rule not in THRESHOLD_RULES:
        raise ValueError(f"unknown RFW threshold rule {rule!r}; choose one of "
                         f"{', '.join(THRESHOLD_RULES)}")
    images = rfw_image_root(root)
    results: dict[str, dict[str, float | int | str]] = {}
    with eval_mode(backbone):
        for group in RFW_GROUPS:
            found = find_rfw_bin(Path(root), group)
            if found is not None:
                emb, issame = _bin_embeddings(backbone, found, batch_size, device,
                                              process_group)
                first, second = emb[0::2], emb[1::2]
            elif images is not None:
                pairs = read_rfw_pairs(images, group)
                unique = {path: i for i, path in enumerate(dict.fromkeys(pairs.first
                                                                         + pairs.second))}
                emb = embed_files(backbone, list(unique), batch_size, device, "RFW")
                first, second = (emb[[unique[p] for p in side]]
                                 for side in (pairs.first, pairs.second))
                issame = pairs.issame
            else:
                raise DataError(f"{root}: no {group}_test.bin, {group}.bin or "
                                f"txts/{group}/{group}_pairs.txt (RFW needs one of them per "
                                f"group: {', '.join(RFW_GROUPS)})")
            row = evaluate_pairs(first, second, issame)
            if rule == "tface":
                row |= tface_accuracy(first, second, issame)
            results[f"RFW/{group}"] = {**row, "threshold_rule": rule}
    results["RFW"] = {**group_summary({g: results[f"RFW/{g}"]["accuracy"] for g in RFW_GROUPS}),
                      "threshold_rule": rule}
    return results


def ijb_row(target: str, protocol: str, image_norm: str) -> str:
    """The result's name, e.g. ``IJBC/1:1/norm-kept``: which protocol and which pooling
    (``norm-kept`` is insightface's eval_ijbc.py, ``unit-norm`` L2-normalises each image
    feature first), so neither is mistaken for the other."""
    return f"{target}/{protocol}/{'norm-kept' if image_norm == 'kept' else 'unit-norm'}"


def evaluate_ijb_dir(backbone: nn.Module, root: str | Path, target: str, batch_size: int,
                     device: torch.device | str, progress: bool = False,
                     image_norms: Sequence[str] = ("kept",),
                     one_to_n: bool = False) -> dict[str, dict[str, float | int | str]]:
    """IJB-B/C 1:1 TAR@FAR (``partial_fc.eval.ijb``) and, with ``one_to_n``, 1:N rank-k and
    TPIR@FPIR (``partial_fc.eval.ijb_1n``) of ``backbone`` on ``root`` (one process).

    Faces are aligned from the 5 landmarks, embedded once with flip TTA
    (:func:`embed_images`, norm kept), then pooled per ``image_norms`` entry.

    Returns:
        ``{ijb_row(...): metrics}``, each metrics dict also naming its ``image_norm``.
    """
    meta = read_ijb_meta(root, target)
    lists = read_ijb_1n_meta(root, target) if one_to_n else None
    batches = iter_aligned_faces(meta, batch_size)
    total = math.ceil(len(meta.names) / batch_size)
    with eval_mode(backbone):
        feats = [embed_images(backbone, b, batch_size, device, normalise=False).cpu()
                 for b in tqdm(batches, total=total, desc=target, disable=not progress)]
    feats = torch.cat(feats).numpy()
    results: dict[str, dict[str, float | int | str]] = {}
    for norm in image_norms:
        results[ijb_row(target, "1:1", norm)] = {
            **evaluate_ijb(feats, meta.templates, meta.medias, meta.face_scores, meta.t1,
                           meta.t2, meta.labels, image_norm=norm), "image_norm": norm}
    if lists is None:
        return results
    for norm in image_norms:
        ids, pooled = template_features(feats, meta.templates, meta.medias, meta.face_scores,
                                        norm)
        gallery, probes = (_template_rows(ids, t, target) for t in
                           (lists.gallery_templates, lists.probe_templates))
        results[ijb_row(target, "1:N", norm)] = {
            **identification(pooled[probes], lists.probe_subjects, pooled[gallery],
                             lists.gallery_subjects), "image_norm": norm}
    return results


def _template_rows(template_ids: np.ndarray, wanted: np.ndarray, target: str) -> np.ndarray:
    """Rows of ``wanted`` templates in sorted ``template_ids``; a template without faces raises."""
    pos = np.minimum(np.searchsorted(template_ids, wanted), len(template_ids) - 1)
    missing = template_ids[pos] != wanted
    if missing.any():
        raise ValueError(f"{target} 1:N lists template {wanted[missing][0]}, which has no "
                         f"faces in {target.lower()}_face_tid_mid.txt")
    return pos


def _read_images(paths: Sequence[Path], what: str) -> np.ndarray:
    """uint8 ``[n, 3, 112, 112]`` of image files (stretched to 112x112 as decoded); a file
    that cannot be read or decoded raises DataError naming it."""
    decoder = resolve_decoder("auto")
    images = []
    for path in paths:
        data = read_image_file(path, what)
        try:
            images.append(decode_image(data, 112, decoder).transpose(2, 0, 1))
        except DataError as exc:
            raise DataError(f"{path}: {exc}") from exc
    return np.stack(images) if images else np.zeros((0, 3, 112, 112), np.uint8)


def embed_files(backbone: nn.Module, paths: Sequence[Path], batch_size: int,
                device: torch.device | str, what: str) -> np.ndarray:
    """Unit flip-summed ``[n, D]`` features of image files, ``batch_size`` files read at a
    time (one process; ``backbone`` in eval mode)."""
    feats = [embed_images(backbone, _read_images(paths[i:i + batch_size], what), batch_size,
                          device).cpu().numpy() for i in range(0, len(paths), batch_size)]
    return np.concatenate(feats) if feats else np.zeros((0, 0), np.float32)


def search_gallery(backbone: nn.Module, probes: np.ndarray, paths: Sequence[Path],
                   skip: np.ndarray, k: int, sizes: Sequence[int], batch_size: int,
                   device: torch.device | str, index: str = "flat", chunk: int = 8192,
                   what: str = "gallery", progress: bool = False) -> dict[int, np.ndarray]:
    """Each probe's ``k`` best scores against the first ``n`` gallery ``paths``, for each
    ``n`` in ``sizes`` (ascending): ``{n: [P, k]}``.

    The gallery is embedded ``chunk`` files at a time and searched
    (:mod:`partial_fc.eval.gallery_search`) as it streams, so memory is one chunk's images
    and features, whatever the gallery's size. Files flagged in ``skip`` are counted in
    ``n`` but neither read nor searched (MegaFace's noise-listed distractors).
    """
    search = top_k_search(probes, k, index)
    out: dict[int, np.ndarray] = {}
    cuts = sorted({0, *sizes})
    with tqdm(total=cuts[-1], desc=what, disable=not progress) as bar:
        for begin, end in itertools.pairwise(cuts):
            for start in range(begin, end, chunk):
                stop = min(start + chunk, end)
                keep = [paths[i] for i in range(start, stop) if not skip[i]]
                search.add(embed_files(backbone, keep, batch_size, device, what))
                bar.update(stop - start)
            out[end] = search.scores()
    return out


def evaluate_tinyface_dir(backbone: nn.Module, root: str | Path, batch_size: int,
                          device: torch.device | str, index: str = "flat",
                          progress: bool = False) -> dict[str, float | int | str]:
    """TinyFace rank-1/5/20 (``partial_fc.eval.ranking.cmc``) of ``backbone`` on ``root``
    (one process), ``"alignment"`` naming the images used: AdaFace's aligned folder
    (``aligned_pad_0.1_pad_high``) where ``data_pipeline.tinyface`` finds it, else ``none``
    (the released crops, stretched to 112x112 as decoded). Embedded with flip TTA, unit
    rows; the distractors are streamed through :func:`search_gallery`."""
    lists = read_tinyface(root)
    matched = lists.num_matched
    distractors = lists.gallery_paths[matched:]
    with eval_mode(backbone):
        probes = embed_files(backbone, lists.probe_paths, batch_size, device, "TinyFace")
        matched_feats = embed_files(backbone, lists.gallery_paths[:matched], batch_size,
                                    device, "TinyFace")
        top = search_gallery(backbone, probes, distractors, np.zeros(len(distractors), bool),
                             max(TINYFACE_RANKS), [len(distractors)], batch_size, device,
                             index, what="TinyFace", progress=progress)[len(distractors)]
    return {**cmc(probes, lists.probe_ids, matched_feats, lists.gallery_ids[:matched],
                  distractor_top=top, distractors=len(distractors)),
            "alignment": ALIGNED_DIR if lists.aligned else "none"}


def evaluate_megaface_dir(backbone: nn.Module, root: str | Path, batch_size: int,
                          device: torch.device | str, sizes: Sequence[int] = MEGAFACE_SIZES,
                          index: str = "flat",
                          progress: bool = False) -> dict[str, dict[str, float | int]]:
    """MegaFace challenge 1 rank-1 (``partial_fc.eval.megaface``) of ``backbone`` on
    insightface's testsuite folder ``root``, at each distractor count in ``sizes`` that the
    list holds (the first ``n`` of ``megaface_lst``): ``{"MegaFace@n": metrics}``."""
    lists = read_megaface(root)
    total = len(lists.distractor_paths)
    wanted = [n for n in sorted(sizes) if n <= total]
    if not wanted:
        raise DataError(f"{root}: megaface_lst holds {total} distractors, fewer than the "
                        f"smallest size asked for ({min(sizes)})")
    with eval_mode(backbone):
        feats = embed_files(backbone, lists.probe_paths, batch_size, device, "FaceScrub")
        feats = clean_probe_features(feats, lists.probe_identities, lists.probe_noisy)
        tops = search_gallery(backbone, feats, lists.distractor_paths, lists.distractor_noisy,
                              1, wanted, batch_size, device, index, what="MegaFace",
                              progress=progress)
    return {f"MegaFace@{n}": {**megaface_identification(feats, lists.probe_identities, top),
                              "gallery_size": n + 1} for n, top in tops.items()}
