"""A teacher's embeddings of every training sample, stored beside the shards' layout so that
offline distillation (``distill.embeddings``) reads them instead of running the teacher.

At Partial-FC scale an online teacher costs a second forward pass on every rank every step;
computed once, the teacher's output is one more field per sample. Layout of ``OUT``::

    OUT/embeddings.json        what was embedded: the teacher, the width, the views, the data
    OUT/<shard stem>.npz       per data shard: ``keys`` (the samples' ``__key__``, in shard
                               order), ``embeddings`` float32 [n, views, D], ``skipped`` (the
                               keys of undecodable samples, which the loader drops too)

``views`` is ``["plain"]`` or ``["plain", "flipped"]``: the teacher's embedding of the image
and of its mirror, the two inputs a flipping run's student can see. The images go through
the loader's decode and ``normalize_images`` (the flip, too, mirrors the uint8 rows as the
engine does), so a stored embedding is the one an online teacher computes on the same batch,
to float rounding. Each shard's file is written atomically when complete: a rerun (any
number of ranks) skips the shards already written, which makes the job resumable.

This module is the layout (a shard file's writer) and its reader, which a run needs;
``offline.embedding_sets`` fills and verifies such a folder for ``launch.embed``.
"""

from __future__ import annotations

import io
import mmap
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from data_pipeline.errors import DataError
from data_pipeline.json_file import read_json
from data_pipeline.manifest import atomic_file
from data_pipeline.npz_file import read_npz

INDEX = "embeddings.json"
MAX_SHARD_BYTES = 16 << 30  # a shard's file: 10^5 samples x 2 views x 512 float32 is 400 MB
FORMAT_VERSION = 1


def shard_file(out: Path, shard_name: str) -> Path:
    """Where the embeddings of the data shard ``shard_name`` are stored under ``out``."""
    return out / (Path(shard_name).name.removesuffix(".tar") + ".npz")


def write_shard(path: Path, keys: Sequence[str], skipped: Sequence[str],
                embeddings: np.ndarray) -> None:
    """One data shard's file, written atomically: ``keys`` in shard order, the ``skipped``
    (undecodable) keys, ``embeddings`` float32 ``[len(keys), views, D]``; uncompressed
    (``np.savez``), which the reader's memory map needs."""
    buffer = io.BytesIO()
    np.savez(buffer, keys=np.array(keys, dtype=str), skipped=np.array(skipped, dtype=str),
             embeddings=embeddings)
    with atomic_file(path) as f:
        f.write(buffer.getvalue())


def read_index(out: str | Path) -> dict:
    """``OUT/embeddings.json``; DataError (one line) when there is none."""
    path = Path(out) / INDEX
    if not path.is_file():
        raise DataError(f"{path}: missing (not a folder python -m launch.embed wrote)")
    return read_json(path, "embedding set index")


class TeacherEmbeddings:
    """The stored embeddings, looked up by sample key, read from the shard files in place.

    A lookup reads only the rows of the keys asked for: each shard's ``.npz`` is memory-mapped
    (:func:`mapped_arrays`) when one of its keys is first asked for, at most ``max_open`` files
    at a time (the least recently used is unmapped), so a rank's resident share is the pages
    of its own samples, which the OS may drop again (clean file pages), not ``N x views x D``
    float32 (21 GB for MS1MV3's 5.2M images at 512-d). What stays in memory is the key index:
    a 64-bit hash of every key with its shard and row, 16 bytes a sample (83 MB for MS1MV3),
    built at start-up from the files' ``keys`` arrays; a hash only proposes a row, the key
    stored there decides (two keys with one hash both resolve).
    """

    def __init__(self, out: str | Path, max_open: int = 64) -> None:
        out = Path(out)
        self.index = read_index(out)
        self.flipped = len(self.index["views"]) == 2
        self.where, self.max_open = out, max_open
        self.files = [shard_file(out, name) for name, _ in self.index["data"]["shards"]]
        hashes, shards, rows = [], [], []
        for number, path in enumerate(self.files):
            if not path.is_file():
                raise DataError(f"{path}: missing (python -m launch.embed did not finish; "
                                "run it again)")
            keys = read_npz(path, ("keys",), str(path), "embedding shard",  # keys alone
                            limit=MAX_SHARD_BYTES)["keys"].tolist()
            hashes.append(np.fromiter(map(hash, keys), np.int64, len(keys)))
            shards.append(np.full(len(keys), number, np.int32))
            rows.append(np.arange(len(keys), dtype=np.int32))
        hashes = np.concatenate(hashes) if hashes else np.empty(0, np.int64)
        order = np.argsort(hashes, kind="stable")
        self._hashes = hashes[order]
        self._shards = np.concatenate(shards)[order] if shards else np.empty(0, np.int32)
        self._rows = np.concatenate(rows)[order] if rows else np.empty(0, np.int32)
        self._open: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()

    @property
    def embedding_size(self) -> int:
        return int(self.index["embedding_size"])

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, key: str) -> bool:
        return self._place(key) is not None

    def mapped_files(self) -> list[Path]:
        """The shard files mapped now (at most ``max_open``), least recently used first."""
        return [self.files[number] for number in self._open]

    def lookup(self, keys: Sequence[str], flips: torch.Tensor | None) -> torch.Tensor:
        """``[n, D]``: each key's plain view, or its flipped one where ``flips`` is set."""
        if flips is not None and not self.flipped and bool(flips.any()):
            raise DataError(f"{self.where}: embedded without flips, but the run flips "
                            "(data.flip=false, or embed again without --no-flip)")
        out = np.empty((len(keys), self.embedding_size), np.float32)
        places = [self._place(key) for key in keys]
        if not places:
            return torch.from_numpy(out)
        if None in places:
            missing = keys[places.index(None)]
            raise DataError(f"{self.where}: no teacher embedding of sample {missing!r} "
                            "(python -m launch.embed --verify names what is off)")
        shards, rows = np.array(places, np.int64).T
        views = (np.zeros(len(keys), np.int64) if flips is None or not self.flipped
                 else flips.cpu().numpy().astype(np.int64))
        for number in np.unique(shards):
            mine = np.flatnonzero(shards == number)
            out[mine] = self._arrays(int(number))["embeddings"][rows[mine], views[mine]]
        return torch.from_numpy(out)

    def _place(self, key: str) -> tuple[int, int] | None:
        """``(shard number, row)`` of ``key``, or None when no shard holds it."""
        wanted = hash(key)
        j = int(np.searchsorted(self._hashes, wanted))
        while j < len(self._hashes) and self._hashes[j] == wanted:
            number, row = int(self._shards[j]), int(self._rows[j])
            if self._arrays(number)["keys"][row] == key:
                return number, row
            j += 1
        return None

    def _arrays(self, number: int) -> dict[str, np.ndarray]:
        """Shard ``number``'s mapped arrays, mapping it (and unmapping the least recently
        used beyond ``max_open``) when it is not mapped."""
        if number in self._open:
            self._open.move_to_end(number)
        else:
            self._open[number] = mapped_arrays(self.files[number])
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)
        return self._open[number]


def mapped_arrays(path: Path) -> dict[str, np.ndarray]:
    """The arrays of the ``.npz`` at ``path`` as read-only views of one memory map of the file
    (``np.load`` would read a member whole). ``np.savez`` stores each array uncompressed, as an
    ``.npy`` file inside the zip: its data starts after the zip's local header (30 bytes, the
    name, the extra field) and the ``.npy`` header."""
    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
    arrays = {}
    with open(path, "rb") as f:
        whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        for member in members:
            if member.compress_type != zipfile.ZIP_STORED:
                raise DataError(f"{path}: {member.filename} is compressed (not a file "
                                "python -m launch.embed wrote)")
            f.seek(member.header_offset + 26)
            name_length, extra_length = struct.unpack("<HH", f.read(4))
            f.seek(member.header_offset + 30 + name_length + extra_length)
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read_header(f)
            arrays[member.filename.removesuffix(".npy")] = np.ndarray(
                shape, dtype, whole, f.tell(), order="F" if fortran else "C")
    return arrays
