"""A folder in an object store that a run writes and reads back: its run folder at a URL
(``output=s3://bucket/runs/a``, ``gs://``, ``az://``, any fsspec URL that writes).

The same client layer as a data folder (:class:`~data_pipeline.remote.RemoteFolder`: fsspec,
the client's standard configuration, :class:`~data_pipeline.remote.Retry`'s retries, one-line
:class:`~data_pipeline.remote.StorageError`), with what a run needs beyond reading shards:
whole files by name, recursive listings, copies of a file tree both ways, and one
conditional write, :meth:`StoreFolder.create`, which makes an object only where none exists.
That is fsspec's ``mode="create"``: S3's ``If-None-Match: *``, GCS's
``ifGenerationMatch=0``, Azure's ``If-None-Match: *`` (adlfs). Nothing here branches on
the scheme.

Every object an object store makes is visible only once its upload is whole, so a reader
never meets half of one; a set of files is complete when the one written last (a
checkpoint's ``meta.json``) is there.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from data_pipeline.remote import RemoteFolder, Retry, StorageError, is_url, open_folder, scrub

NO_CONDITIONAL_WRITE = (
    "{url}: this store ignores conditional writes (a second create of {name} replaced the "
    "first), so no lease can hold the run folder there; real S3, GCS and Azure honour them "
    "(some emulators do not): run there, or set output_lock=false and make sure yourself that "
    "one job writes this folder")


class StoreFolder(RemoteFolder):
    """A writable folder at ``url`` (not ``file://``: :func:`open_store`). Names are paths
    relative to it (``checkpoints/step-00000010/meta.json``)."""

    def __init__(self, url: str, retry: Retry):
        super().__init__(url, retry)
        self._honours_create: bool | None = None  # learnt at the first create

    def get(self, name: str) -> bytes | None:
        """The whole of file ``name``, None when it is not there."""
        url = self.url_of(name)

        def get() -> bytes | None:
            try:
                return self.fs.cat_file(url)
            except FileNotFoundError:
                return None

        return self._retried(url, get)

    def put(self, name: str, data: bytes | Path) -> None:
        """Store ``data`` (bytes, or a local file's) as ``name``, replacing any."""
        self.upload(data, name)

    def create(self, name: str, data: bytes) -> bool:
        """Store ``data`` as ``name`` only where no object of that name exists: True when
        this call made it, False when one was there. The first call that makes one also
        checks that the store honours the condition (a second create must fail); a store
        that does not raises :class:`StorageError` (:data:`NO_CONDITIONAL_WRITE`)."""
        made = self._create(name, data)
        if made and self._honours_create is None:
            self._honours_create = not self._create(name, data)
            if not self._honours_create:
                self.remove(name)
        if made and not self._honours_create:
            raise StorageError(NO_CONDITIONAL_WRITE.format(url=self.shown, name=name))
        return made

    def _create(self, name: str, data: bytes) -> bool:
        url = self.url_of(name)

        def create() -> bool:
            try:
                self.fs.pipe_file(url, data, mode="create")
            except FileExistsError:
                return False
            return True

        return self._retried(url, create)

    def tree(self, prefix: str = "") -> dict[str, int]:
        """Every file under ``prefix`` (the whole folder by default), by name relative to
        the folder, with its size; from one fresh listing, ``{}`` when there is none."""
        url = self.url_of(prefix).rstrip("/")
        _ = self.fs  # sets self.path: the folder as its client names it
        base = self.path.rstrip("/") + "/"

        def listing() -> dict[str, int]:
            self.fs.invalidate_cache()  # another process (rank, job) may have written since
            try:
                found = self.fs.find(url, detail=True)
            except FileNotFoundError:
                return {}
            return {path[len(base):]: int(entry.get("size") or 0)
                    for path, entry in found.items()
                    if entry.get("type") != "directory" and path.startswith(base)}

        return self._retried(url, listing)

    def download(self, name: str, path: Path) -> None:
        """Copy file ``name`` to the local ``path`` (written under a temporary name, then
        renamed: a reader of ``path`` never meets half of it)."""
        url = self.url_of(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.part")
        self._retried(url, lambda: self.fs.get_file(url, str(part)))
        os.replace(part, path)

    def upload_tree(self, local: Path, prefix: str) -> None:
        """Every file under the local folder ``local`` to ``prefix/<its relative path>``."""
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            self.put(f"{prefix}/{path.relative_to(local).as_posix()}", path)

    def remove_tree(self, prefix: str) -> None:
        """Delete every file under ``prefix`` (nothing when there is none)."""
        for name in self.tree(prefix):
            self.remove(name)


def open_store(location: str, retry: Retry | None = None) -> StoreFolder | Path:
    """A run folder's location: a local :class:`Path` for a path or ``file://`` URL, else a
    :class:`StoreFolder` (its client made now, so a missing one is a one-line
    :class:`StorageError` naming the extra that installs it, and a URL with credentials in
    it is refused as a data URL is)."""
    folder = open_folder(location, retry)
    if isinstance(folder, Path):
        return folder
    store = StoreFolder(folder.url, folder.retry)
    _ = store.fs  # the client now: a missing one is reported before anything starts
    return store


def in_store(location: str) -> bool:
    """Whether the run folder ``location`` is in a store (a URL, not ``file://``)."""
    return is_url(location) and not location.startswith("file://")


def local_path(location: str) -> Path:
    """The folder ``location`` names on this machine: a path, a ``file://`` URL's path, or
    for a store URL its node-local copy (:func:`staging_dir`)."""
    if in_store(location):
        return staging_dir(location)
    return Path(location.removeprefix("file://"))


def staging_dir(url: str, purpose: str = "run", tmpdir: str | os.PathLike | None = None
                ) -> Path:
    """This node's copy of the folder at ``url``: the same path on every rank of a node
    (``tmpdir``, by default ``TMPDIR``, then the URL's last name and a hash of the whole), one
    per ``purpose`` (a run writes ``run``; a reader such as ``launch.report`` copies into its
    own)."""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:12]
    name = url.rstrip("/").rsplit("/", 1)[-1]
    root = tmpdir or os.environ.get("TMPDIR") or tempfile.gettempdir()  # read now, not cached
    return Path(root) / "partial-fc" / purpose / f"{name}-{digest}"


__all__ = ["NO_CONDITIONAL_WRITE", "StorageError", "StoreFolder", "in_store", "local_path",
           "open_store", "scrub", "staging_dir"]
