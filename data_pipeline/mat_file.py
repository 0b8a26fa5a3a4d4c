"""The one reader of MATLAB files (TinyFace's lists), bounded before scipy sees them.

scipy's ``loadmat`` inflates a compressed variable whole and allocates a cell array at the
dimensions its header states (``np.empty(prod(dims), object)``) before it reads a cell, so a
few hundred bytes can ask for gigabytes. Here the file comes through the door
(:func:`data_pipeline.door.read_bytes`, at most the caller's limit), every compressed
variable is inflated no further than :data:`MAX_EXPANDED` bytes in all, and every array's
header is walked (MAT 5's layout: a tag of type and byte count, then the array's flags,
dimensions, name and contents, arrays nested in cells and structs) to check that it states
no more elements than it has bytes (each element of a cell, struct, character or numeric
array takes one at least) and is of a class a list holds (no sparse, object or function
handle). Only then does ``loadmat`` read the checked bytes. MAT 4 and 7.3 (HDF5) files are
refused: the released TinyFace lists are MAT 5.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zlib
from typing import Any

from data_pipeline.door import read_bytes
from data_pipeline.errors import DataError

MAX_EXPANDED = 64 << 20  # the released TinyFace lists are ~100 KB inflated
MAX_DEPTH = 32  # arrays nested in cells or structs
_MATRIX, _COMPRESSED = 14, 15  # miMATRIX, miCOMPRESSED
_CLASSES = {1, 2, 4, *range(6, 16)}  # cell, struct, char, the numeric classes


def read_mat(path: str | os.PathLike, what: str, *, limit: int) -> dict[str, Any]:
    """The variables of the MATLAB file ``path`` (``scipy.io.loadmat``), checked first as
    the module docstring says; DataError (one line naming the file and ``what`` it is)
    when it cannot be read, is over ``limit`` bytes, states more than it holds or is not a
    MATLAB 5 file scipy reads."""
    from scipy.io import loadmat

    data = read_bytes(path, what, limit=limit)
    try:
        checked = _checked(data)
        return loadmat(io.BytesIO(checked))
    except Exception as exc:  # scipy's reader raises its own errors, zlib's, struct's...
        raise DataError(f"{path}: not a readable MATLAB file ({type(exc).__name__}: "
                        f"{str(exc)[:120]})") from None


def _checked(data: bytes) -> bytes:
    """``data`` with every compressed variable inflated (bounded), each array walked."""
    if len(data) < 128 or data[126:128] not in (b"IM", b"MI"):
        raise ValueError("no MATLAB 5 header")
    order = "<" if data[126:128] == b"IM" else ">"
    if struct.unpack_from(order + "H", data, 124)[0] != 0x0100:
        raise ValueError("not a MATLAB 5 file (MAT 4 or 7.3)")
    out, pos, expanded = [data[:128]], 128, 0
    while pos < len(data):
        at = pos
        kind, start, end, pos = _element(data, pos, len(data), order, padded=False)
        body = data[start:end]
        if kind == _COMPRESSED:  # inflated: the element it holds, tag and all
            inflate = zlib.decompressobj()
            body = inflate.decompress(body, MAX_EXPANDED - expanded + 1)
            expanded += len(body)
            if expanded > MAX_EXPANDED:
                raise ValueError(f"inflates past {MAX_EXPANDED} bytes")
            _walk(body, 0, len(body), order, 0)
            out.append(body)
            continue
        if kind == _MATRIX:
            _matrix(body, order, 0)
        out.append(data[at:pos])
    return b"".join(out)


def _element(data: bytes, pos: int, end: int, order: str,
             padded: bool = True) -> tuple[int, int, int, int]:
    """The element at ``pos``: its type, its data's start and end, and where the next one
    starts (MAT 5's small elements pack up to 4 bytes into the tag)."""
    if pos + 8 > end:
        raise ValueError(f"a tag cut at byte {pos}")
    kind, size = struct.unpack_from(order + "II", data, pos)
    if kind >> 16:  # small element: byte count in the upper half, data in the tag's 4 bytes
        return kind & 0xFFFF, pos + 4, pos + 4 + min(kind >> 16, 4), pos + 8
    if pos + 8 + size > end:
        raise ValueError(f"an element of {size} bytes at byte {pos} runs past its end")
    stop = pos + 8 + size
    return kind, pos + 8, stop, min(end, stop + (-size % 8 if padded else 0))


def _walk(data: bytes, pos: int, end: int, order: str, depth: int) -> None:
    """Every array among the elements of ``data[pos:end]``, checked."""
    while pos < end:
        kind, start, stop, pos = _element(data, pos, end, order)
        if kind == _MATRIX:
            _matrix(data[start:stop], order, depth)
        elif kind == _COMPRESSED:
            raise ValueError("a compressed element inside another")


def _matrix(body: bytes, order: str, depth: int) -> None:
    """One array (an miMATRIX's data): its class allowed, its dimensions within its bytes,
    and the arrays it holds."""
    if depth >= MAX_DEPTH:
        raise ValueError(f"arrays nested deeper than {MAX_DEPTH}")
    if not body:  # an empty cell
        return
    _, start, _, pos = _element(body, 0, len(body), order)
    flags = struct.unpack_from(order + "I", body, start)[0]
    _, start, stop, pos = _element(body, pos, len(body), order)
    dims = struct.unpack_from(f"{order}{(stop - start) // 4}i", body, start)
    if flags & 0xFF not in _CLASSES:
        raise ValueError(f"an array of MATLAB class {flags & 0xFF} (a list holds cells, "
                         "structs, text and numbers)")
    if min(dims, default=0) < 0 or math.prod(dims) > len(body):
        raise ValueError(f"an array of dimensions {list(dims)[:4]} in {len(body)} bytes")
    _walk(body, pos, len(body), order, depth + 1)
