"""Find RFW's test sets (Wang et al., ICCV 2019): one per group, as ``.bin`` or raw images.

Two forms are read:

- insightface's ``.bin`` per group, ``<group>_test.bin`` or ``<group>.bin`` (what TFace's
  ``recognition/test/verification_rfw.py`` loads);
- the released folder (``RFW/test``, or a folder holding ``test/``)::

      txts/<group>/<group>_pairs.txt   LFW's pair format, tab-separated:
                                       <id> <n1> <n2>            same identity
                                       <id1> <n1> <id2> <n2>     different identities
      data/<group>/<id>/<id>_<n, 4 digits>.jpg

  The images must already be aligned 112x112 crops (the form the ``.bin`` sets hold).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from data_pipeline.door import is_index, read_text
from data_pipeline.errors import DataError

MAX_LIST_BYTES = 16 << 20  # a group's pair list: 3,000 pairs, ~100 KB


@dataclass(frozen=True)
class RfwPairs:
    """One group's ``P`` pairs of image files, in the list's order."""

    first: list[Path]
    second: list[Path]
    issame: list[bool]


def find_rfw_bin(folder: Path, group: str) -> Path | None:
    """``folder/<group>_test.bin`` or ``folder/<group>.bin``, whichever exists."""
    for name in (f"{group}_test.bin", f"{group}.bin"):
        if (folder / name).is_file():
            return folder / name
    return None


def rfw_image_root(root: str | os.PathLike) -> Path | None:
    """The released folder holding ``txts/`` and ``data/`` (``root`` or ``root/test``)."""
    for folder in (Path(root), Path(root) / "test"):
        if (folder / "txts").is_dir():
            return folder
    return None


def _image(folder: Path, group: str, identity: str, number: str, where: str) -> Path:
    if not is_index(number):
        raise DataError(f"{where}: image number {number[:40]!r} is not 1-12 ASCII digits")
    return folder / "data" / group / identity / f"{identity}_{int(number):04d}.jpg"


def read_rfw_pairs(folder: Path, group: str) -> RfwPairs:
    """The pairs of ``folder/txts/<group>/<group>_pairs.txt``; a missing file or a line of
    neither 3 nor 4 fields raises DataError naming it."""
    path = folder / "txts" / group / f"{group}_pairs.txt"
    lines = read_text(path, "RFW pair list", limit=MAX_LIST_BYTES).splitlines()
    first, second, issame = [], [], []
    for number, line in enumerate(lines, 1):
        fields, where = line.split(), f"{path}:{number}"
        if not fields:
            continue
        if len(fields) == 3:
            ids = (fields[0], fields[1], fields[0], fields[2])
        elif len(fields) == 4:
            ids = tuple(fields)
        else:
            raise DataError(f"{where}: {len(fields)} fields; expected '<id> <n1> <n2>' or "
                            "'<id1> <n1> <id2> <n2>'")
        first.append(_image(folder, group, ids[0], ids[1], where))
        second.append(_image(folder, group, ids[2], ids[3], where))
        issame.append(len(fields) == 3)
    if not issame:
        raise DataError(f"{path}: no pairs")
    return RfwPairs(first, second, issame)
