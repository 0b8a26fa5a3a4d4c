"""Where a conversion's files go (data_pipeline.writer): a local folder, or a folder at a URL.

A local folder (or a ``file://`` URL) is written in place, each file atomically
(manifest.atomic_file). A folder on an object store (``s3://``, ``gs://``, any store fsspec
writes) is written through a local staging folder: a shard and its member index are written
there, uploaded (the index first, so that a shard's presence means both are there) and
deleted, so the staging disk holds one shard at a time. An object becomes visible only once
its upload is whole, and the writer uploads ``manifest.json`` last: a prefix without it is an
unfinished conversion, which every reader refuses. A rerun keeps the shards already uploaded
(each is fetched once to hash it for the manifest, as a local rerun reads its finished shards
again). A web server (``http(s)://``) is read-only: refused in one line.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from data_pipeline.json_file import fetch_json, read_json
from data_pipeline.manifest import atomic_write_bytes
from data_pipeline.remote import RemoteFolder, StorageError, open_folder
from data_pipeline.remote_shards import local_copy
from data_pipeline.shard_index import INDEX_SUFFIX

SHARD_PATTERN = "shard-*.tar"
# fsspec's web client can POST a file, but a web server is no store to convert into
READ_ONLY_PROTOCOLS = {"http", "https"}


@contextlib.contextmanager
def open_output(location: str | os.PathLike) -> Iterator[LocalOutput | RemoteOutput]:
    """The output folder of a conversion at ``location`` (a path or a URL), for the block:
    a remote one's staging folder is removed when it ends."""
    folder = open_folder(location)
    if isinstance(folder, Path):
        folder.mkdir(parents=True, exist_ok=True)
        yield LocalOutput(folder)
        return
    protocols = folder.fs.protocol
    if READ_ONLY_PROTOCOLS.intersection([protocols] if isinstance(protocols, str) else protocols):
        raise StorageError(f"{folder.shown}: a web server is read-only; convert into a local "
                           "folder or an object store (s3://, gs://) and serve that")
    with tempfile.TemporaryDirectory(prefix="partial-fc-convert-") as staging:
        yield RemoteOutput(folder, Path(staging))


class LocalOutput:
    """A local output folder: files written in place, atomically."""

    def __init__(self, folder: Path):
        self.folder, self.shown = folder, str(folder)

    def where(self, name: str) -> str:
        return str(self.folder / name)

    def read_json(self, name: str, what: str) -> Any:
        """The JSON object in file ``name`` (size-checked before it is read), None when it
        is not there."""
        path = self.folder / name
        return read_json(path, what) if path.is_file() else None

    def has_shards(self) -> bool:
        return any(self.folder.glob(SHARD_PATTERN))

    def write(self, name: str, data: bytes) -> None:
        atomic_write_bytes(self.folder / name, data)

    def remove(self, name: str) -> None:
        (self.folder / name).unlink(missing_ok=True)

    @contextlib.contextmanager
    def finished(self, name: str) -> Iterator[Path | None]:
        """Shard ``name`` when an earlier run finished it (a shard file is renamed into
        place only when whole), else None."""
        path = self.folder / name
        yield path if path.is_file() else None

    def staged(self, name: str) -> Path:
        """Where to write shard ``name``."""
        return self.folder / name

    def publish(self, *paths: Path) -> None:
        """Written in place already."""


class RemoteOutput:
    """An output folder at a URL, written through the local folder ``staging``."""

    def __init__(self, folder: RemoteFolder, staging: Path):
        self.folder, self.staging, self.shown = folder, staging, folder.shown
        self.present = folder.listing()  # what an earlier run left there, by name

    def where(self, name: str) -> str:
        return f"{self.shown}/{name}"

    def read_json(self, name: str, what: str) -> Any:
        """The JSON object in file ``name``, its size from the listing checked before it is
        fetched; None when it is not there."""
        if name not in self.present:
            return None
        return fetch_json(self.folder, name, what, size=self.present[name])

    def has_shards(self) -> bool:
        return bool(fnmatch.filter(self.present, SHARD_PATTERN))

    def write(self, name: str, data: bytes) -> None:
        self.folder.upload(data, name)

    def remove(self, name: str) -> None:
        self.folder.remove(name)

    @contextlib.contextmanager
    def finished(self, name: str) -> Iterator[Path | None]:
        """A local copy of shard ``name`` (and its index) when an earlier run uploaded it,
        else None."""
        if name not in self.present:
            yield None
            return
        with local_copy(self.folder, name, self.present[name],
                        name + INDEX_SUFFIX in self.present) as path:
            yield path

    def staged(self, name: str) -> Path:
        return self.staging / name

    def publish(self, *paths: Path) -> None:
        """Upload ``paths`` in order, then delete those in the staging folder."""
        for path in paths:
            self.folder.upload(path, path.name)
            if path.parent == self.staging:
                path.unlink()
