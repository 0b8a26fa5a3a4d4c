"""Shard writing: atomic tar shards plus a manifest, resumable after a crash.

Layout of `OUT/`:
  shard-000000.tar ...   samples `KEY.jpg` (encoded image), `KEY.cls` (ASCII int label),
                         `KEY.src` (ASCII original index: record id or relative path);
                         KEY is the 9-digit write position, unique in the data set.
  shard-000000.tar.idx   each shard's member index (data_pipeline.shard_index), written
                         after its shard.
  identities.json        the label-to-identity map (data_pipeline.identities), named in
                         the manifest.
  manifest.json          written last; its presence means the conversion finished.
  .convert.json          the conversion's fingerprint while it runs (removed at the end).

`OUT` may be a URL of an object store: each shard is uploaded as it is finished and the
manifest last (data_pipeline.output).

Atomicity: a shard is written through manifest.atomic_file (`NAME.tmp`, fsync, rename, folder
fsync), so a file named `shard-*.tar` is always complete. Resume: shard i always holds write
positions [i*S, (i+1)*S) of a fixed (seeded) permutation of the source, so a restarted
conversion with the same fingerprint keeps the finished shards and rewrites only the missing ones.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from data_pipeline.codec import MAX_PIXELS, prepare_jpeg
from data_pipeline.errors import CorruptImageError, DataError
from data_pipeline.identities import IDENTITIES_NAME, Identities, identities_bytes
from data_pipeline.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    atomic_file,
    manifest_bytes,
    manifest_of,
)
from data_pipeline.output import LocalOutput, RemoteOutput, open_output
from data_pipeline.shard_index import build_index, index_path, write_index

DEFAULT_SAMPLES_PER_SHARD = 10_000
PROGRESS_NAME = ".convert.json"


@dataclass(frozen=True)
class Sample:
    """One stored sample: `key` (no dots), encoded image, integer label, original index."""

    key: str
    jpg: bytes
    label: int
    src: str


class Source(Protocol):
    """What a converter reads from: random access so shards can be written in any order."""

    num_classes: int

    def __len__(self) -> int: ...

    def describe(self) -> dict:
        """JSON-able description (type, path, options): the manifest's `source` field."""
        ...

    def read(self, index: int) -> tuple[bytes, int, str]:
        """(encoded image bytes, label, original index as text) of item `index`."""
        ...

    def identity_map(self) -> Identities:
        """The identity of each label 0..num_classes-1, and where the names come from."""
        ...


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


def write_shard(path: Path, samples: Iterable[Sample]) -> ShardInfo:
    """Write one tar shard atomically, then its member index (data_pipeline.shard_index);
    members get mtime 0 and fixed ownership (reproducible)."""
    count = 0
    with atomic_file(path) as raw:
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for sample in samples:
                assert "." not in sample.key, sample.key
                for ext, payload in (("jpg", sample.jpg), ("cls", str(sample.label).encode()),
                                     ("src", sample.src.encode())):
                    info = tarfile.TarInfo(f"{sample.key}.{ext}")
                    info.size, info.mode, info.mtime = len(payload), 0o644, 0
                    tar.addfile(info, io.BytesIO(payload))
                count += 1
    write_index(path, build_index(path))
    return _shard_info(path, count)


def _shard_info(path: Path, count: int) -> ShardInfo:
    """The manifest's entry of the finished shard ``path`` of ``count`` samples."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return ShardInfo(path.name, count, path.stat().st_size, digest)


def write_dataset(source: Source, out_dir: str | os.PathLike, *, size: int | None = 112,
                  samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD,
                  shuffle_seed: int | None = 0, max_pixels: int = MAX_PIXELS,
                  progress: Callable[[int], None] | None = None) -> tuple[Manifest, list[str]]:
    """Convert `source` into shards + manifest under `out_dir` (a folder or a URL,
    data_pipeline.output); resumes an interrupted run.

    size: stored images are size x size (see codec.prepare_jpeg); None keeps them as they are.
    shuffle_seed: samples are written in a seeded random order (None = source order), so each
        shard mixes identities and the loader's shuffle buffer sees a varied stream.
    max_pixels: an image whose header claims more pixels is refused before it is decoded
        (codec.MAX_PIXELS by default).
    progress: called with the number of samples just handled (finished shards included).
    Returns (manifest, "original (why)" for each image that could not be decoded for
    re-encoding or was refused; they are stored verbatim and the loader will skip them).
    """
    n = len(source)
    if n == 0:
        raise DataError(f"{source.describe().get('path', source)}: no images found")
    if samples_per_shard < 1:
        raise DataError(f"samples_per_shard={samples_per_shard}: must be >= 1")
    if size is not None and size < 1:  # else every image fails to re-encode, stored as corrupt
        raise DataError(f"size={size}: must be >= 1 (None keeps images as they are)")
    # max_pixels decides which images are stored re-encoded: a resume under another limit
    # would mix the two in one folder, so it is part of what a resume must match
    fingerprint = {"source": source.describe(), "num_samples": n, "size": size,
                   "samples_per_shard": samples_per_shard, "shuffle_seed": shuffle_seed,
                   "max_pixels": max_pixels}
    with open_output(out_dir) as out:
        return _write(source, out, fingerprint, progress)


def _write(source: Source, out: LocalOutput | RemoteOutput, fingerprint: dict,
           progress: Callable[[int], None] | None) -> tuple[Manifest, list[str]]:
    """write_dataset's work, into ``out``."""
    n, size, max_pixels = fingerprint["num_samples"], fingerprint["size"], fingerprint["max_pixels"]
    samples_per_shard, shuffle_seed = fingerprint["samples_per_shard"], fingerprint["shuffle_seed"]
    done = _check_resumable(out, fingerprint)
    if done is not None:
        if progress:
            progress(n)
        return done, []
    order = (np.random.default_rng(shuffle_seed).permutation(n) if shuffle_seed is not None
             else np.arange(n))
    shards, corrupt = [], []

    def samples(start: int, stop: int):
        for pos in range(start, stop):
            data, label, src = source.read(int(order[pos]))
            if not 0 <= label < source.num_classes:
                raise DataError(f"{src}: label {label} outside [0, {source.num_classes})")
            try:
                data = prepare_jpeg(data, size, max_pixels)
            except CorruptImageError as exc:
                corrupt.append(f"{src} ({exc})")
            yield Sample(f"{pos:09d}", data, label, src)
            if progress:
                progress(1)

    for i, start in enumerate(range(0, n, samples_per_shard)):
        stop = min(start + samples_per_shard, n)
        with out.finished(shard_name(i)) as path:
            if path is not None:
                if not index_path(path).is_file():  # stopped between the shard and its index
                    write_index(path, build_index(path))
                    out.publish(index_path(path))
                shards.append(_shard_info(path, stop - start))
                if progress:
                    progress(stop - start)
                continue
        path = out.staged(shard_name(i))
        shards.append(write_shard(path, samples(start, stop)))
        out.publish(index_path(path), path)  # the index first: a shard means both are there
    identities = source.identity_map()
    assert len(identities.names) == source.num_classes, (len(identities.names), source)
    out.write(IDENTITIES_NAME, identities_bytes(identities))  # before the manifest naming it
    manifest = Manifest(num_classes=source.num_classes, num_samples=n, shards=tuple(shards),
                        source=_manifest_source(fingerprint), identities=IDENTITIES_NAME)
    out.write(MANIFEST_NAME, manifest_bytes(manifest))
    out.remove(PROGRESS_NAME)
    return manifest, corrupt


def _manifest_source(fingerprint: dict) -> dict:
    """The manifest's `source`: the source's description plus the conversion options."""
    return {**fingerprint["source"], "size": fingerprint["size"],
            "samples_per_shard": fingerprint["samples_per_shard"],
            "shuffle_seed": fingerprint["shuffle_seed"]}


def _check_resumable(out: LocalOutput | RemoteOutput, fingerprint: dict) -> Manifest | None:
    """Record the fingerprint, or check a previous run's; return the manifest if already done."""
    stored = out.read_json(MANIFEST_NAME, "manifest")
    if stored is not None:
        manifest = manifest_of(stored, out.where(MANIFEST_NAME))
        if (manifest.source == _manifest_source(fingerprint)
                and manifest.num_samples == fingerprint["num_samples"]):
            return manifest
        raise DataError(f"{out.where(MANIFEST_NAME)}: folder already holds a different "
                        f"conversion ({manifest.source}); choose an empty output folder")
    settings = out.read_json(PROGRESS_NAME, "conversion progress file")
    if settings is not None:
        changed = sorted(k for k in settings.keys() | fingerprint.keys()
                         if settings.get(k) != fingerprint.get(k))
        if changed:
            shown = ", ".join(f"{k} {str(settings.get(k))[:60]} -> {str(fingerprint.get(k))[:60]}"
                              for k in changed[:4])
            raise DataError(f"{out.where(PROGRESS_NAME)}: an unfinished conversion with other "
                            f"settings ({shown}) is in this folder; resume it with its own, "
                            "or delete it or choose another folder")
    elif out.has_shards():
        raise DataError(f"{out.shown}: holds shards but no {PROGRESS_NAME} or {MANIFEST_NAME}; "
                        "choose an empty output folder")
    out.write(PROGRESS_NAME, json.dumps(fingerprint, indent=1).encode())
    return None
