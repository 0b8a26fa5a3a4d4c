"""Read the TinyFace test set (Cheng et al., ACCV 2018): probe, matched gallery, distractors.

Layout of the released ``tinyface/Testing_Set`` folder::

    probe_img_ID_pairs.mat           MATLAB: probe_set (cell of file names), probe_ids
    gallery_match_img_ID_pairs.mat   MATLAB: gallery_set, gallery_ids
    Probe/<name>  Gallery_Match/<name>  Gallery_Distractor/<name>

Distractors have no identity (id -1 here: the released ids are positive). The path given may
be ``Testing_Set`` itself or a folder holding ``Testing_Set`` or ``tinyface/Testing_Set``.

The released images are unaligned low-resolution crops. The published numbers (AdaFace's
``validation_lq/validate_tinyface.py``, which CVLface's toolkit follows) are measured on
images aligned first: MTCNN on the crops padded by 10 %, 112x112 results saved under
``<data_root>/aligned_pad_0.1_pad_high/{Probe,Gallery_Match,Gallery_Distractor}/`` (their
README; the aligned set is handed out behind a form), where ``<data_root>`` holds
``tinyface/Testing_Set``. Where that folder exists, its images are read in place of the
released ones, matched by file name without extension as AdaFace matches them; otherwise the
released crops are used as they are (:attr:`TinyFaceLists.aligned` says which).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_pipeline.errors import DataError
from data_pipeline.mat_file import read_mat

DISTRACTOR_ID = -1
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
ALIGNED_DIR = "aligned_pad_0.1_pad_high"
# The reference read and followed: validation_lq/validate_tinyface.py, tinyface_helper.py.
ADAFACE_COMMIT = "c60eaa786a42c03444f3df7096dbaf9d57ae010d"
SUBSETS = ("Probe", "Gallery_Match", "Gallery_Distractor")
MAX_LIST_BYTES = 16 << 20  # the released .mat lists are ~100 KB


@dataclass(frozen=True)
class TinyFaceLists:
    """``P`` probe images and ``G`` gallery images (the matched ones, then the distractors)."""

    probe_paths: list[Path]
    probe_ids: np.ndarray  # [P] int64
    gallery_paths: list[Path]
    gallery_ids: np.ndarray  # [G] int64, DISTRACTOR_ID for distractors
    aligned: bool = False  # images from aligned_pad_0.1_pad_high/, not the released crops

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
    mat = read_mat(path, "a TinyFace list", limit=MAX_LIST_BYTES)
    try:
        names = [str(np.asarray(cell).reshape(-1)[0]) for cell in mat[names_key].reshape(-1)]
        ids = np.asarray(mat[ids_key], dtype=np.int64).reshape(-1)
    except KeyError as exc:
        raise DataError(f"{path}: no variable {exc} (needs {names_key} and {ids_key})") from exc
    except (ValueError, TypeError, IndexError, AttributeError, OverflowError) as exc:
        raise DataError(f"{path}: unreadable {names_key}/{ids_key} ({str(exc)[:120]})"
                        ) from exc
    if len(names) != len(ids):
        raise DataError(f"{path}: {len(names)} entries in {names_key} but {len(ids)} in {ids_key}")
    return names, ids


def _aligned_folder(testing_set: Path) -> Path | None:
    """``<data_root>/aligned_pad_0.1_pad_high`` beside ``<data_root>/tinyface/Testing_Set``
    (or inside the folder given as Testing_Set's parent)."""
    for root in (testing_set.parent, testing_set.parent.parent):
        if (root / ALIGNED_DIR).is_dir():
            return root / ALIGNED_DIR
    return None


def _images(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise DataError(f"{folder}: missing (expected the released TinyFace layout)")
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)


def _in_aligned(paths: list[Path], aligned: Path, subset: str) -> list[Path]:
    """Each released image's aligned twin (same name without extension) in ``aligned/subset``."""
    by_stem = {p.stem: p for p in _images(aligned / subset)}
    missing = [p.name for p in paths if p.stem not in by_stem]
    if missing:
        raise DataError(f"{aligned / subset}: no aligned image for {missing[0]} "
                        f"({len(missing)} of {len(paths)} missing)")
    return [by_stem[p.stem] for p in paths]


def read_tinyface(root: str | os.PathLike) -> TinyFaceLists:
    """The probe and gallery lists of the TinyFace test set under ``root``, aligned images
    where ``aligned_pad_0.1_pad_high/`` is found (see the module's docstring)."""
    folder = _testing_set(Path(root))
    probes, probe_ids = _names_and_ids(folder / "probe_img_ID_pairs.mat", "probe_set",
                                       "probe_ids")
    matched, matched_ids = _names_and_ids(folder / "gallery_match_img_ID_pairs.mat",
                                          "gallery_set", "gallery_ids")
    distractors = _images(folder / "Gallery_Distractor")
    lists = [[folder / "Probe" / n for n in probes],
             [folder / "Gallery_Match" / n for n in matched], distractors]
    aligned = _aligned_folder(folder)
    if aligned is not None:
        lists = [_in_aligned(paths, aligned, subset)
                 for paths, subset in zip(lists, SUBSETS, strict=True)]
    return TinyFaceLists(
        probe_paths=lists[0], probe_ids=probe_ids, gallery_paths=lists[1] + lists[2],
        gallery_ids=np.concatenate([matched_ids, np.full(len(distractors), DISTRACTOR_ID)]),
        aligned=aligned is not None,
    )
