"""`OUT/manifest.json`: what a shard folder holds, written last so it marks completion.

The loader plans every epoch from the manifest alone (per-shard sample counts give each
rank an equal share without opening a tar), and the trainer checks `num_classes` and
`num_samples` against its config.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

from data_pipeline.errors import DataError
from data_pipeline.json_file import fetch_json, read_json
from data_pipeline.remote import RemoteFolder, open_folder, scrub

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class ShardInfo:
    """One tar shard: file name relative to the data folder, sample count, size in bytes,
    and its SHA-256 (hex; "" in manifests written before it was recorded), which a node-local
    cache of a remote folder checks each fetched shard against (data_pipeline.shard_cache)."""

    name: str
    count: int
    bytes: int
    sha256: str = ""


@dataclass(frozen=True)
class Manifest:
    """A converted data set. `source` describes where it came from (type, path, options);
    `identities` names the file beside it holding the label-to-identity map
    (data_pipeline.identities; "" in folders converted before it was written)."""

    num_classes: int
    num_samples: int
    shards: tuple[ShardInfo, ...]
    source: dict = field(default_factory=dict)
    version: int = FORMAT_VERSION
    identities: str = ""

    @property
    def shard_counts(self) -> list[int]:
        return [s.count for s in self.shards]


def read_manifest(data_dir: str | os.PathLike | RemoteFolder) -> Manifest:
    """Load and validate ``data_dir/manifest.json`` (a local folder or a URL,
    data_pipeline.remote); raises DataError naming the file on problems."""
    folder = data_dir if isinstance(data_dir, RemoteFolder) else open_folder(data_dir)
    if isinstance(folder, Path):
        path = folder / MANIFEST_NAME
        if not path.is_file():
            raise DataError(f"{path}: no manifest (not a converted data folder, "
                            "or its conversion did not finish)")
        return manifest_of(read_json(path, "manifest"), str(path))
    return manifest_of(fetch_json(folder, MANIFEST_NAME, "manifest"), folder.url_of(MANIFEST_NAME))


def manifest_of(raw: dict, where: str) -> Manifest:
    """The manifest whose parsed JSON object is ``raw`` (read from ``where``), validated."""
    path = scrub(where)
    try:
        shards = tuple(ShardInfo(str(s["name"]), int(s["count"]), int(s["bytes"]),
                                 str(s.get("sha256", ""))) for s in raw["shards"])
        manifest = Manifest(num_classes=int(raw["num_classes"]),
                            num_samples=int(raw["num_samples"]), shards=shards,
                            source=dict(raw.get("source", {})),
                            version=int(raw.get("version", FORMAT_VERSION)),
                            identities=str(raw.get("identities", "")))
    except (ValueError, KeyError, TypeError, OverflowError) as exc:
        raise DataError(f"{path}: malformed manifest ({type(exc).__name__}: {exc})") from exc
    if manifest.version != FORMAT_VERSION:
        raise DataError(f"{path}: version {manifest.version} unsupported "
                        f"(expected {FORMAT_VERSION})")
    total = sum(manifest.shard_counts)
    if total != manifest.num_samples:
        raise DataError(f"{path}: num_samples={manifest.num_samples} but the shard counts "
                        f"sum to {total}")
    if manifest.num_classes < 1 or not manifest.shards:
        raise DataError(f"{path}: num_classes={manifest.num_classes}, {len(shards)} shards: empty")
    return manifest


def write_manifest(data_dir: str | os.PathLike, manifest: Manifest) -> Path:
    """Write the manifest atomically (temp file, fsync, rename)."""
    path = Path(data_dir) / MANIFEST_NAME
    atomic_write_bytes(path, manifest_bytes(manifest))
    return path


def manifest_bytes(manifest: Manifest) -> bytes:
    """The manifest as ``manifest.json`` stores it."""
    payload = asdict(manifest)
    payload["shards"] = [{k: v for k, v in asdict(s).items() if v != ""} for s in manifest.shards]
    if not manifest.identities:
        del payload["identities"]
    return (json.dumps(payload, indent=1) + "\n").encode()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through :func:`atomic_file`."""
    with atomic_file(path) as f:
        f.write(data)


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` when the block ends without error. Readers see
    either the old file or the complete new one, never a prefix; the new one survives a power
    cut once the block returns (the file and its folder entry fsynced). An error leaves
    ``path`` untouched (and ``NAME.tmp`` behind, overwritten by the next attempt)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in ``folder`` durable (POSIX: fsync the directory)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
