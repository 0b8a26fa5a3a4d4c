"""insightface verification sets (``lfw.bin``, ``cfp_fp.bin``, ``agedb_30.bin`` ...).

A ``.bin`` is a pickle of ``(images, issame)``: ``images`` a list of 2·P encoded
images (JPEG/PNG bytes, pair p = images 2p and 2p+1) and ``issame`` P flags.
Pickles can run arbitrary code, and these files are downloaded from mirrors, so
they are read with an unpickler that refuses every global lookup: the opcodes
that build lists, tuples, bytes, bools and ints need none, while anything that
calls (``REDUCE``, ``BUILD``, ``INST``, ``OBJ``, ``NEWOBJ``, extension codes)
must first fetch a callable through :meth:`pickle.Unpickler.find_class`, which
raises before anything runs. Python-2 ``str`` images load as bytes
(``encoding="bytes"``), which is how the original files were written.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
from pathlib import Path

from data_pipeline.door import read_bytes
from data_pipeline.manifest import atomic_write_bytes


class UnsafeBinError(ValueError):
    """The ``.bin`` file is not a plain ``(list[bytes], list[bool])`` pickle."""


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path) -> None:
        super().__init__(file, encoding="bytes")
        self._path = path

    def find_class(self, module: str, name: str):
        raise UnsafeBinError(
            f"{self._path}: refusing to unpickle global {module}.{name}; a verification .bin "
            "may only hold lists, tuples, bytes, bools and ints"
        )

    def persistent_load(self, pid):
        raise UnsafeBinError(f"{self._path}: refusing persistent id {pid!r} in a verification .bin")


MAX_BIN_BYTES = 1 << 30  # insightface's largest, cfp_fp.bin, is ~90 MB

MISSING_BIN_FIX = ("insightface's data sets bring lfw.bin, cfp_fp.bin, agedb_30.bin; "
                   "`make data/orl_s31-s40.bin` writes a small one")


def read_bin(path: str | os.PathLike) -> tuple[list[bytes], list[bool]]:
    """Read an insightface verification ``.bin`` without executing anything.

    Returns:
        ``(images, issame)``: 2·P encoded images and P same-identity flags.

    Raises:
        UnsafeBinError: the pickle asks for a global or holds another type or shape.
    """
    path = Path(path)
    data = read_bytes(path, "a verification .bin", limit=MAX_BIN_BYTES, error=UnsafeBinError)
    try:
        for _ in pickletools.genops(data):  # every declared length checked against the file,
            pass  # before the unpickler makes a buffer of that length (a bytes8 of 2^40)
        obj = _RestrictedUnpickler(io.BytesIO(data), path).load()
    except UnsafeBinError:
        raise
    except Exception as exc:  # truncated or not a pickle at all
        raise UnsafeBinError(f"{path}: not a readable verification .bin "
                             f"({type(exc).__name__}: {str(exc)[:120]})") from exc
    if not (isinstance(obj, tuple | list) and len(obj) == 2):
        raise UnsafeBinError(f"{path}: expected a pair (images, issame), got {type(obj).__name__}")
    images, issame = obj
    _check_types(path, images, issame)
    return list(images), [bool(x) for x in issame]


def _check_types(path: Path, images, issame) -> None:
    if not isinstance(images, list | tuple) or not all(isinstance(b, bytes) for b in images):
        raise UnsafeBinError(f"{path}: images must be a list of bytes")
    if not isinstance(issame, list | tuple) or not all(
        isinstance(x, bool | int) and x in (0, 1) for x in issame
    ):
        raise UnsafeBinError(f"{path}: issame must be a list of bools")
    if len(images) != 2 * len(issame):
        raise UnsafeBinError(
            f"{path}: {len(images)} images for {len(issame)} pairs (need 2 per pair)"
        )


def write_bin(path: str | os.PathLike, images: list[bytes], issame: list[bool]) -> None:
    """Write ``(images, issame)`` in the insightface layout, atomically (``atomic_write_bytes``)."""
    path = Path(path)
    images = [bytes(b) for b in images]
    issame = [bool(x) for x in issame]
    _check_types(path, images, issame)
    atomic_write_bytes(path, pickle.dumps((images, issame), protocol=4))
