"""Source for an insightface data set folder: `train.rec`, `train.idx` (+ `property`).

`property` is "num_classes,height,width". Without it the class count comes from record 0's
identity range (b - a, see recordio.py), or, for a `.rec` with no header record, from the
largest label + 1 (one pass over the headers). Labels are the image header's float label
(or the first entry of its label vector), checked to be integral and converted to int.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from data_pipeline.door import read_bytes
from data_pipeline.errors import DataError
from data_pipeline.identities import Identities, numbered
from data_pipeline.recordio import RecordIOReader, unpack


class InsightFaceSource:
    """`Source` (see writer.py) over SRC/train.rec + SRC/train.idx."""

    def __init__(self, src_dir: str | os.PathLike, *, rec_name: str = "train"):
        self.root = Path(src_dir)
        self.reader = RecordIOReader(self.root / f"{rec_name}.rec", self.root / f"{rec_name}.idx")
        keys = self.reader.keys
        header0 = unpack(self.reader.read(0))[0] if 0 in self.reader.index else None
        if header0 is not None and header0.flag > 0:
            first_identity = self._count(header0.label[0], "record 0's first identity key")
            self.keys = list(range(1, first_identity))
            range_classes = (self._count(header0.label[1] - first_identity,
                                         "record 0's identity range (class count)")
                             if header0.flag > 1 else None)
        else:
            self.keys, range_classes = keys, None
        self.num_classes = (self._read_property() or range_classes
                            or self._count(self._max_label() + 1, "largest label + 1"))

    def _count(self, value: float, what: str) -> int:
        """``value`` (a key or a class count the `.rec` or `property` states) as an int; a
        DataError unless it is an integer within the records the `.idx` lists (each key,
        image and identity has one), before anything of that size is made."""
        records = len(self.reader.index)
        if not (math.isfinite(value) and value == int(value) and 0 <= value <= records + 1):
            where = self.root / "property" if what == "class count" else self.reader.rec_path
            raise DataError(f"{where}: {what} is {value}, not an integer within the "
                            f"{records} records of {self.reader.idx_path.name}")
        return int(value)

    def _read_property(self) -> int | None:
        path = self.root / "property"
        if not path.is_file():
            return None
        text = read_bytes(path, "an insightface property file", limit=4096).decode(
            errors="replace").strip()
        try:
            return self._count(int(text.split(",")[0]), "class count")
        except ValueError as exc:
            raise DataError(f"{path}: expected 'num_classes,height,width', got "
                            f"{text[:80]!r}") from exc

    def _max_label(self) -> int:
        return max(self.read_label(i) for i in range(len(self.keys)))

    def __len__(self) -> int:
        return len(self.keys)

    def describe(self) -> dict:
        return {"type": "insightface", "path": str(self.root.resolve()), "records": len(self)}

    def identity_map(self) -> Identities:
        """The .rec's own labels: a ``.rec`` stores a label per image (and each identity's
        image range), never a name."""
        return numbered(self.num_classes, f"the labels of {self.reader.rec_path.resolve()} "
                        "(a .rec stores no identity names)")

    def read_label(self, index: int) -> int:
        return self._label(self.keys[index], unpack(self.reader.read(self.keys[index]))[0])

    def read(self, index: int) -> tuple[bytes, int, str]:
        key = self.keys[index]
        header, image = unpack(self.reader.read(key))
        return image, self._label(key, header), str(key)

    def _label(self, key: int, header) -> int:
        value = header.label[0] if header.flag > 0 else header.label
        if not math.isfinite(value) or value != int(value) or value < 0:
            raise DataError(f"{self.reader.rec_path}: record {key} has label {value}, "
                            "expected a non-negative integer")
        return int(value)
