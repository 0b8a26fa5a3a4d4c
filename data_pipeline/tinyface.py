"""Read the TinyFace test set (Cheng et al., ACCV 2018): probe, matched gallery, distractors.

Layout of the released ``tinyface/Testing_Set`` folder::

    probe_img_ID_pairs.mat           MATLAB: probe_set (cell of file names), probe_ids
    gallery_match_img_ID_pairs.mat   MATLAB: gallery_set, gallery_ids
    Probe/<name>  Gallery_Match/<name>  Gallery_Distractor/<name>

Distractors have no identity (id -1 here: the released ids are positive). The path given may
be ``Testing_Set`` itself or a folder holding ``Testing_Set`` or ``tinyface/Testing_Set``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.io import loadmat

from data_pipeline.errors import DataError

DISTRACTOR_ID = -1
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


@dataclass(frozen=True)
class TinyFaceLists:
    """``P`` probe images and ``G`` gallery images (the matched ones, then the distractors)."""

    probe_paths: list[Path]
    probe_ids: np.ndarray  # [P] int64
    gallery_paths: list[Path]
    gallery_ids: np.ndarray  # [G] int64, DISTRACTOR_ID for distractors

    @property
    def num_matched(self) -> int:
        """How many gallery images (the first ones) have an identity."""
        return int((self.gallery_ids != DISTRACTOR_ID).sum())


def _testing_set(root: Path) -> Path:
    for folder in (root, root / "Testing_Set", root / "tinyface" / "Testing_Set"):
        if (folder / "probe_img_ID_pairs.mat").is_file():
            return folder
    raise DataError(f"{root}: no probe_img_ID_pairs.mat here or in Testing_Set/ or "
                    "tinyface/Testing_Set/ (expected the released TinyFace layout)")


def _names_and_ids(path: Path, names_key: str, ids_key: str) -> tuple[list[str], np.ndarray]:
    if not path.is_file():
        raise DataError(f"{path}: missing (expected the released TinyFace layout)")
    try:
        mat = loadmat(path)
        names = [str(np.asarray(cell).reshape(-1)[0]) for cell in mat[names_key].reshape(-1)]
        ids = np.asarray(mat[ids_key], dtype=np.int64).reshape(-1)
    except KeyError as exc:
        raise DataError(f"{path}: no variable {exc} (needs {names_key} and {ids_key})") from exc
    except (ValueError, TypeError, IndexError) as exc:
        raise DataError(f"{path}: unreadable {names_key}/{ids_key} ({exc})") from exc
    if len(names) != len(ids):
        raise DataError(f"{path}: {len(names)} entries in {names_key} but {len(ids)} in {ids_key}")
    return names, ids


def read_tinyface(root: str | os.PathLike) -> TinyFaceLists:
    """The probe and gallery lists of the TinyFace test set under ``root``."""
    folder = _testing_set(Path(root))
    probes, probe_ids = _names_and_ids(folder / "probe_img_ID_pairs.mat", "probe_set",
                                       "probe_ids")
    matched, matched_ids = _names_and_ids(folder / "gallery_match_img_ID_pairs.mat",
                                          "gallery_set", "gallery_ids")
    distractor_dir = folder / "Gallery_Distractor"
    if not distractor_dir.is_dir():
        raise DataError(f"{distractor_dir}: missing (expected the released TinyFace layout)")
    distractors = sorted(p for p in distractor_dir.iterdir()
                         if p.suffix.lower() in IMAGE_SUFFIXES)
    return TinyFaceLists(
        probe_paths=[folder / "Probe" / n for n in probes], probe_ids=probe_ids,
        gallery_paths=[folder / "Gallery_Match" / n for n in matched] + distractors,
        gallery_ids=np.concatenate([matched_ids, np.full(len(distractors), DISTRACTOR_ID)]),
    )
