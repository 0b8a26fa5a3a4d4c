"""What makes a checkpoint folder trustworthy before anything in it is unpickled.

``meta.json`` (plain JSON) lists the SHA-256 of every other file of the folder, written last
by ``trainer.checkpoint.save``; :func:`verify` re-hashes them all and refuses a folder with a
missing, changed or unlisted file. DCP keeps its ``.metadata`` as a pickle, so
:class:`SafeReader` reads it through an allow-list of DCP's metadata classes and torch value
types; the tensors themselves DCP reads with ``weights_only=True``. A folder whose manifest
was rewritten along with a planted pickle is therefore still refused, and no code runs.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import StorageMeta

from data_pipeline.json_file import read_json
from trainer.checkpoint.meta import CheckpointMeta
from trainer.errors import Refused, Stopped

META = "meta.json"


class CheckpointError(Stopped, ValueError):
    """A checkpoint that cannot be written or trusted; the message names the step or file."""


class CheckpointNotFound(Refused):
    """A checkpoint path the user gave (``checkpoint.resume``) holds none: bad input (exit 2),
    not a checkpoint that failed (:class:`CheckpointError`, exit 1)."""


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_meta(path: Path) -> CheckpointMeta:
    """The meta.json of checkpoint folder ``path`` (plain JSON: safe before verification)."""
    meta = read_json(Path(path) / META, f"checkpoint {META}", error=CheckpointError)
    try:
        return CheckpointMeta.from_json(meta)
    except TypeError as exc:  # a field of the wrong type or a key missing
        raise CheckpointError(f"{Path(path) / META}: incomplete ({exc})") from None


def verify(path: Path, only: Collection[str] | None = None,
           present: Collection[str] | None = None, shown: str | None = None) -> dict:
    """Check folder ``path`` against its meta.json before anything in it is unpickled;
    returns the meta dict. Raises :class:`CheckpointError` naming the first bad file.

    Every file must be listed and present; ``only`` limits the hashing to the files a reader
    will open (evaluation reads ``backbone.pt`` alone, and hashing a multi-million-class
    head's rows and optimizer state would cost it tens of seconds for nothing). ``present``:
    the names the checkpoint holds where ``path`` is a local copy of the ``only`` files of
    one in a store (``shown``, its URL, names it in the errors)."""
    path = Path(path)
    where = shown if shown is not None else str(path)
    meta = read_json(path / META, f"checkpoint {META}", error=CheckpointError,
                     where=f"{where}/{META}")
    files = meta.get("files")
    if not (isinstance(files, dict) and all(isinstance(v, str) for v in files.values())):
        raise CheckpointError(f"{where}/{META}: incomplete ('files' is not a map of names "
                              "to SHA-256 digests)")
    if present is None:
        present = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}
    present = set(present) - {META}
    extra = sorted(present - set(files))
    if extra:
        raise CheckpointError(f"{where}/{extra[0]}: not listed in {META}; refusing the folder")
    unlisted = sorted(set(only or ()) - set(files))
    if unlisted:
        raise CheckpointError(f"{where}/{unlisted[0]}: not listed in {META}")
    for name, digest in files.items():
        if name not in present:
            raise CheckpointError(f"{where}/{name}: missing (listed in {META})")
        if (only is None or name in only) and sha256(path / name) != digest:
            raise CheckpointError(f"{where}/{name}: SHA-256 differs from {META}: corrupted or "
                                  "replaced")
    return meta


class AllowListUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: DCP's metadata classes and the torch/pathlib value types
    they hold, nothing else. A name outside the list is refused before its module is even
    imported, so a planted pickle cannot call ``os.system`` & co."""

    CLASSES_FROM = "torch.distributed.checkpoint.metadata"
    NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"),
             ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
             ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
             ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str):
        if module == self.CLASSES_FROM:  # classes only: no function of DCP may be called
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in self.NAMES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


class SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader with the metadata pickle read through the allow-list."""

    def __init__(self, folder: Path):
        super().__init__(folder)
        self.folder = Path(folder)

    def read_metadata(self, *args, **kwargs):
        file = self.folder / ".metadata"
        try:
            with open(file, "rb") as f:
                metadata = AllowListUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as exc:
            raise CheckpointError(f"{file}: not DCP metadata ({exc})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
