"""A teacher's embeddings of a data folder, written and verified for ``launch.embed``.

The layout and the reader a distilling run uses are ``trainer.teacher_embeddings``'s; this
module fills such a folder shard by shard (every ``world_size``-th shard per rank, each file
written atomically when complete, so a rerun resumes) and checks it against the data.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from data_pipeline.codec import decode_image, resolve_decoder
from data_pipeline.errors import CorruptImageError, DataError
from data_pipeline.manifest import atomic_write_bytes, read_manifest
from data_pipeline.npz_file import read_npz
from data_pipeline.tar_reader import tar_samples
from partial_fc.backbones import normalize_images
from trainer.teacher_embeddings import (
    FORMAT_VERSION,
    INDEX,
    MAX_SHARD_BYTES,
    mapped_arrays,
    read_index,
    shard_file,
    write_shard,
)


def _index(teacher: str, width: int, flip: bool, data_dir: Path) -> dict:
    manifest = read_manifest(data_dir)
    return {"format_version": FORMAT_VERSION, "teacher": teacher, "embedding_size": width,
            "views": ["plain", "flipped"] if flip else ["plain"],
            "data": {"num_samples": manifest.num_samples,
                     "shards": [[s.name, s.count] for s in manifest.shards]}}



@torch.no_grad()
def embed_shards(teacher: nn.Module, teacher_name: str, data_dir: str | Path, out: str | Path,
                 *, flip: bool, rank: int = 0, world_size: int = 1, batch_size: int = 64,
                 device: torch.device | str = "cpu") -> list[str]:
    """Embed this rank's shards (every ``world_size``-th, from ``rank``) of ``data_dir`` into
    ``out``; returns the names of the shards it wrote (those already complete are skipped).

    Raises DataError when ``out`` holds the embeddings of another teacher, width, views or
    data (a resume must not mix them).
    """
    data_dir, out = Path(data_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    teacher = teacher.eval().to(device)
    probe = teacher(torch.zeros(1, 3, 112, 112, device=device))
    index = _index(teacher_name, int(probe.shape[1]), flip, data_dir)
    if (out / INDEX).is_file():
        found = read_index(out)
        if found != index:
            changed = sorted(k for k in index if found.get(k) != index[k])
            raise DataError(f"{out / INDEX}: written for another {', '.join(changed)}; "
                            "give another --out, or delete it to start over")
    elif rank == 0:  # one writer: the ranks' renames of one temporary file raced
        atomic_write_bytes(out / INDEX, (json.dumps(index, indent=1) + "\n").encode())
    written = []
    decoder = resolve_decoder("auto")
    for number, (name, _) in enumerate(index["data"]["shards"]):
        target = shard_file(out, name)
        if number % world_size != rank or target.is_file():
            continue
        keys, skipped, rows = [], [], []
        for sample in tar_samples(data_dir / name, exts=("jpg",)):
            try:
                rows.append(decode_image(sample["jpg"], 112, decoder).transpose(2, 0, 1))
                keys.append(sample["__key__"])
            except (CorruptImageError, KeyError):
                skipped.append(sample["__key__"])
        parts = [_embed(teacher, np.stack(rows[i:i + batch_size]), flip, device)
                 for i in range(0, len(rows), batch_size)]
        width = index["embedding_size"]
        embeddings = (np.concatenate(parts) if parts
                      else np.zeros((0, len(index["views"]), width), np.float32))
        write_shard(target, keys, skipped, embeddings)
        written.append(name)
    return written


def _embed(teacher: nn.Module, images: np.ndarray, flip: bool, device) -> np.ndarray:
    """uint8 ``[n, 3, 112, 112]`` -> float32 ``[n, views, D]``."""
    u8 = torch.from_numpy(images).to(device)
    views = [teacher(normalize_images(u8)).float()]
    if flip:
        mirror = torch.ones(len(u8), dtype=torch.bool, device=device)
        views.append(teacher(normalize_images(u8, mirror)).float())
    return torch.stack(views, dim=1).cpu().numpy()


def verify(data_dir: str | Path, out: str | Path) -> list[str]:
    """The problems of ``out`` against ``data_dir``, one line each (``[]``: every sample of
    every shard has its embedding, or is recorded as undecodable, in the shard's order)."""
    data_dir, out = Path(data_dir), Path(out)
    index = read_index(out)
    manifest = read_manifest(data_dir)
    problems = []
    if index["data"]["shards"] != [[s.name, s.count] for s in manifest.shards]:
        problems.append(f"{out / INDEX}: embedded another data set than {data_dir}")
        return problems
    for shard in manifest.shards:
        path = shard_file(out, shard.name)
        if not path.is_file():
            problems.append(f"{path}: missing (run python -m launch.embed again to finish)")
            continue
        stored = read_npz(path, ("keys", "skipped"), str(path), "embedding shard",
                          limit=MAX_SHARD_BYTES)
        keys, skipped = stored["keys"].tolist(), set(stored["skipped"].tolist())
        shape = mapped_arrays(path)["embeddings"].shape
        data_keys = [s["__key__"] for s in tar_samples(data_dir / shard.name, exts=())]
        if keys != [k for k in data_keys if k not in skipped]:
            problems.append(f"{path}: keys differ from {data_dir / shard.name}'s")
        if shape != (len(keys), len(index["views"]), index["embedding_size"]):
            problems.append(f"{path}: embeddings of shape {shape} for {len(keys)} keys")
    return problems
