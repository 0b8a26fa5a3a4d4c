"""The one reader of NumPy archives (``.npz``): a shard's member index, an embedding set's
shards.

``np.load`` of an archive member allocates the array at the shape its ``.npy`` header states
before a byte of its data is read: an index of a few hundred bytes whose header claims
``(10**12, 4)`` asks for 32 TB, and the shape is only checked afterwards. Here each member
wanted is sized first: the archive is at most the caller's limit, the member is stored
uncompressed as ``np.savez`` stores it (the project's writers use nothing else; a compressed
member could state any size) and lies within the archive, and its ``.npy`` header's shape x
item size plus the header is exactly its size; only then is it read (``allow_pickle=False``:
an object array is refused).
"""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Sequence
from typing import BinaryIO

import numpy as np

from data_pipeline.door import check_size
from data_pipeline.errors import DataError


def read_npz(source: str | os.PathLike | BinaryIO, names: Sequence[str], where: str,
             what: str, *, limit: int, error: type[Exception] = DataError,
             hint: str = "") -> dict[str, np.ndarray]:
    """The arrays ``names`` of the archive ``source`` (a path, or a file object of its
    bytes), each checked against its stated size and ``limit`` (bytes, all members
    together) before it is read; ``error`` naming ``where`` and ``what`` the file is (and
    ``hint``: what fixes it) when it is unreadable, lacks a member or states another size."""
    try:
        if isinstance(source, str | os.PathLike):
            size = os.stat(source).st_size
        else:
            size = source.seek(0, os.SEEK_END)
            source.seek(0)
        check_size(size, where, what, limit, error)
        with zipfile.ZipFile(source) as archive:
            return {name: _member(archive, archive.getinfo(f"{name}.npy"), size)
                    for name in names}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        if isinstance(exc, error):
            raise
        raise error(f"{where}: unreadable {what} ({type(exc).__name__}: {str(exc)[:120]})"
                    f"{hint}") from None


def _member(archive: zipfile.ZipFile, member: zipfile.ZipInfo, size: int) -> np.ndarray:
    """One ``.npy`` member of an archive of ``size`` bytes, stored as ``np.savez`` stores it
    and within the archive, its header's shape and dtype checked against its size first."""
    if member.compress_type != zipfile.ZIP_STORED or member.compress_size != member.file_size \
            or member.header_offset + member.file_size > size:
        raise ValueError(f"{member.filename}: {member.file_size} bytes stated, not stored "
                         f"within the archive's {size} as np.savez stores it")
    with archive.open(member) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(f)
        if dtype.hasobject:
            raise ValueError(f"{member.filename} holds Python objects")
        data = math.prod(shape) * dtype.itemsize
        if f.tell() + data != member.file_size:
            raise ValueError(f"{member.filename}'s header states {shape} {dtype} "
                             f"({data} bytes), the member holds {member.file_size - f.tell()}")
    with archive.open(member) as f:
        return np.lib.format.read_array(f, allow_pickle=False)
