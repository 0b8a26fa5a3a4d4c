"""MXNet RecordIO (`.rec` + `.idx`) reading without mxnet, as insightface ships its data sets.

Format (dmlc-core recordio.h, mxnet/recordio.py), all little-endian:
  record  := uint32 magic 0xced7230a, uint32 lrecord, payload, zero padding to 4 bytes
  lrecord := cflag << 29 | length   (length < 2^29 bytes of payload, padding excluded)
  cflag   := 0 whole record | 1 first part | 2 middle part | 3 last part. The writer splits
             a payload wherever the magic number occurs at a 4-aligned offset and drops that
             magic; the reader joins the parts re-inserting it.
  `.idx`  := text lines "key<TAB>byte offset of the record".
An image record's payload (mx.recordio.pack) is the 24-byte IRHeader
  struct "<IfQQ": flag (uint32), label (float32), id (uint64), id2 (uint64),
then, when flag > 0, a float32 label vector of `flag` entries (label field unused), then the
encoded image. In insightface sets record 0 is a header-only record whose label vector
(a, b) says image records are keys 1..a-1 and identity records a..b-1 (so b - a classes).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from data_pipeline.door import read_bytes
from data_pipeline.errors import DataError

MAGIC = 0xCED7230A
IR_FORMAT = "<IfQQ"
IR_SIZE = struct.calcsize(IR_FORMAT)
LENGTH_MASK = (1 << 29) - 1
MAX_IDX_BYTES = 1 << 30  # a line is ~16 bytes: 5 M records are ~80 MB


@dataclass(frozen=True)
class IRHeader:
    """Image record header; `label` is a float, or a tuple of floats when flag > 0."""

    flag: int
    label: float | tuple[float, ...]
    id: int
    id2: int


def unpack(payload: bytes) -> tuple[IRHeader, bytes]:
    """Split an image record payload into its header and the encoded image bytes."""
    if len(payload) < IR_SIZE:
        raise DataError(f"record of {len(payload)} bytes is shorter than the 24-byte header")
    flag, label, id1, id2 = struct.unpack_from(IR_FORMAT, payload)
    rest = payload[IR_SIZE:]
    if flag > 0:
        if len(rest) < 4 * flag:
            raise DataError(f"record header says {flag} labels but only {len(rest)} bytes follow")
        label = struct.unpack_from(f"<{flag}f", rest)
        rest = rest[4 * flag:]
    return IRHeader(flag, label, id1, id2), rest


def read_index(idx_path: Path, rec_bytes: int) -> dict[int, int]:
    """Parse a `.idx` file into {key: byte offset}; DataError naming the line for one that is
    not ``key<TAB>offset`` or points outside the ``rec_bytes`` of its `.rec`."""
    index = {}
    data = read_bytes(idx_path, "an insightface .idx", limit=MAX_IDX_BYTES)
    for lineno, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            key, offset = line.split(b"\t")
            index[int(key)] = int(offset)
        except ValueError as exc:
            raise DataError(f"{idx_path}:{lineno}: expected 'key<TAB>offset', "
                            f"got {line.strip()[:80].decode(errors='replace')!r}") from exc
        if not 0 <= index[int(key)] < rec_bytes:
            raise DataError(f"{idx_path}:{lineno}: offset {int(offset)} outside the "
                            f"{rec_bytes} bytes of its .rec")
    return index


class RecordIOReader:
    """Random access to the records of a `.rec` file through its `.idx`."""

    def __init__(self, rec_path: str | os.PathLike, idx_path: str | os.PathLike):
        self.rec_path, self.idx_path = Path(rec_path), Path(idx_path)
        for path in (self.rec_path, self.idx_path):
            if not path.is_file():
                raise DataError(f"{path}: file not found (give the folder of insightface's "
                                "train.rec, train.idx and property, e.g. faces_emore)")
        self.rec_bytes = self.rec_path.stat().st_size
        self.index = read_index(self.idx_path, self.rec_bytes)
        self._file = open(self.rec_path, "rb")  # noqa: SIM115 - closed by close()/__exit__

    @property
    def keys(self) -> list[int]:
        return sorted(self.index)

    def read(self, key: int) -> bytes:
        """The payload of record `key`, multi-part records joined."""
        if key not in self.index:
            raise DataError(f"{self.idx_path}: no record with key {key}")
        offset = self.index[key]
        self._file.seek(offset)
        parts = []
        while True:
            head = self._file.read(8)
            if len(head) < 8:
                raise DataError(f"{self.rec_path}: truncated record header at byte "
                                f"{self._file.tell() - len(head)} (key {key})")
            magic, lrecord = struct.unpack("<II", head)
            if magic != MAGIC:
                raise DataError(f"{self.rec_path}: bad magic {magic:#010x} at byte "
                                f"{self._file.tell() - 8} (key {key}, idx offset {offset})")
            cflag, length = lrecord >> 29, lrecord & LENGTH_MASK
            left = self.rec_bytes - self._file.tell()
            if length > left:  # refused before a buffer of its declared size is made
                raise DataError(f"{self.rec_path}: record {key} truncated "
                                f"({left} of {length} bytes)")
            data = self._file.read((length + 3) & ~3)
            parts.append(data[:length])
            if cflag in (0, 3):
                return struct.pack("<I", MAGIC).join(parts)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RecordIOReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
