"""Read the MegaFace challenge 1 test set as insightface's testsuite ships it.

insightface's ``recognition/_evaluation_/megaface/`` (``gen_megaface.py``, ``remove_noises.py``)
reads a ``data/`` folder of aligned 112x112 crops::

    facescrub_lst            one path per line, <identity>/<file> under facescrub_images/
    megaface_lst             one path per line, <a>/<b>/<file> under megaface_images/
    facescrub_images/...     the probe identities' images (FaceScrub)
    megaface_images/...      the distractors (MegaFace, up to ~10^6)
    facescrub_noises.txt     optional: file names of mislabelled FaceScrub images ('#' comments)
    megaface_noises.txt      optional: <a>/<b>/<file> of distractors that show a FaceScrub
                             identity (a line may carry a tab-separated prefix)

A FaceScrub image's identity is its folder name. The path given may be that folder or one
holding ``data/``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_pipeline.door import read_text
from data_pipeline.errors import DataError

PROBE_LIST, DISTRACTOR_LIST = "facescrub_lst", "megaface_lst"
PROBE_NOISES, DISTRACTOR_NOISES = "facescrub_noises.txt", "megaface_noises.txt"
MAX_LIST_BYTES = 256 << 20  # megaface_lst: ~10^6 paths of ~50 bytes


@dataclass(frozen=True)
class MegaFaceLists:
    """``P`` FaceScrub images and ``G`` distractors, in list order."""

    probe_paths: list[Path]
    probe_identities: np.ndarray  # [P] int64, one number per FaceScrub folder name
    probe_noisy: np.ndarray  # [P] bool: listed in facescrub_noises.txt
    distractor_paths: list[Path]
    distractor_noisy: np.ndarray  # [G] bool: listed in megaface_noises.txt


def _folder(root: Path) -> Path:
    for folder in (root, root / "data"):
        if (folder / PROBE_LIST).is_file():
            return folder
    raise DataError(f"{root}: no {PROBE_LIST} here or in data/ (expected insightface's "
                    "MegaFace testsuite layout)")


def _lines(path: Path, skip_comments: bool = False) -> list[str]:
    text = read_text(path, "MegaFace list", limit=MAX_LIST_BYTES)
    lines = [line.strip() for line in text.splitlines()]
    return [line for line in lines if line and not (skip_comments and line.startswith("#"))]


def _parts(path: Path, line: str, depth: int, number: int) -> list[str]:
    parts = line.split("/")
    if len(parts) < depth or not all(parts[-depth:]):
        raise DataError(f"{path}: line {number} {line[:80]!r} is not a path of {depth} parts "
                        f"({'<identity>/<file>' if depth == 2 else '<a>/<b>/<file>'})")
    return parts[-depth:]


def read_megaface(root: str | os.PathLike) -> MegaFaceLists:
    """The probe and distractor lists of the MegaFace testsuite under ``root``."""
    folder = _folder(Path(root))
    probe_lines = _lines(folder / PROBE_LIST)
    distractor_lines = _lines(folder / DISTRACTOR_LIST)
    if not probe_lines or not distractor_lines:
        raise DataError(f"{folder / (PROBE_LIST if not probe_lines else DISTRACTOR_LIST)}: "
                        "empty list")
    names = [_parts(folder / PROBE_LIST, line, 2, i + 1) for i, line in enumerate(probe_lines)]
    keys = ["/".join(_parts(folder / DISTRACTOR_LIST, line, 3, i + 1))
            for i, line in enumerate(distractor_lines)]
    probe_noises = _optional(folder / PROBE_NOISES)
    # remove_noises.py keys a distractor noise line by its last tab-separated field.
    distractor_noises = {line.split("\t")[-1] for line in _optional(folder / DISTRACTOR_NOISES)}
    identity_number: dict[str, int] = {}
    return MegaFaceLists(
        probe_paths=[folder / "facescrub_images" / line for line in probe_lines],
        probe_identities=np.array([identity_number.setdefault(a, len(identity_number))
                                   for a, _ in names], np.int64),
        probe_noisy=np.array([b in probe_noises for _, b in names], bool),
        distractor_paths=[folder / "megaface_images" / line for line in distractor_lines],
        distractor_noisy=np.array([key in distractor_noises for key in keys], bool),
    )


def _optional(path: Path) -> set[str]:
    return set(_lines(path, skip_comments=True)) if path.exists() else set()
