"""Read the insightface ``IJB_release`` layout and align its faces to 112x112.

Layout (``T`` = ``IJBB`` or ``IJBC``, ``t`` its lower case)::

    ROOT/meta/t_face_tid_mid.txt          "<image> <template id> <media id>" per face
    ROOT/meta/t_template_pair_label.txt   "<template 1> <template 2> <1 same | 0 different>"
    ROOT/meta/t_name_5pts_score.txt       "<image> x1 y1 ... x5 y5 <detector score>"
    ROOT/loose_crop/<image>

``ROOT`` is the folder holding ``meta/`` (``IJB_release/IJBC``); ``IJB_release`` itself
is accepted too. The two per-face files must list the same images in the same order.

Alignment: the similarity transform (rotation, uniform scale, translation) that
maps the 5 detected landmarks onto ArcFace's 112x112 reference points in the
least-squares sense (Umeyama), estimated and applied with scikit-image, bilinear,
black outside the crop; the same warp insightface does with OpenCV.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from skimage.transform import SimilarityTransform, warp

from data_pipeline.errors import DataError

# ArcFace 112x112 reference landmarks (eyes, nose tip, mouth corners), x then y:
# the 96x112 points of SphereFace/insightface shifted right by 8 pixels.
ARCFACE_REFERENCE = np.array(
    [[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366],
     [41.5493, 92.3655], [70.7299, 92.2041]], dtype=np.float64)
TARGETS = ("IJBB", "IJBC")


@dataclass(frozen=True)
class IJBMeta:
    """One IJB protocol: ``N`` faces and ``M`` template pairs."""

    root: Path
    names: list[str]  # [N] image file names under root/loose_crop
    templates: np.ndarray  # [N] int64
    medias: np.ndarray  # [N] int64
    landmarks: np.ndarray  # [N, 5, 2] float64, (x, y) in the loose crop
    face_scores: np.ndarray  # [N] float64 detector scores
    t1: np.ndarray  # [M] int64
    t2: np.ndarray  # [M] int64
    labels: np.ndarray  # [M] int64, 1 = same identity


def _rows(path: Path, width: int | None) -> list[list[str]]:
    if not path.is_file():
        raise DataError(f"{path}: missing (expected the insightface IJB_release layout)")
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows, 1):
        if width is not None and len(row) != width:
            raise DataError(f"{path}:{i}: expected {width} fields, got {len(row)}")
    return rows


def read_ijb_meta(root: str | os.PathLike, target: str = "IJBC") -> IJBMeta:
    """Parse the three meta files of ``target`` (``IJBB`` | ``IJBC``) under ``root``."""
    if target not in TARGETS:
        raise DataError(f"ijb target {target!r}: choose one of {', '.join(TARGETS)}")
    root = Path(root)
    if not (root / "meta").is_dir() and (root / target / "meta").is_dir():
        root = root / target
    meta, t = root / "meta", target.lower()
    faces = _rows(meta / f"{t}_face_tid_mid.txt", 3)
    points = _rows(meta / f"{t}_name_5pts_score.txt", 12)
    pairs = _rows(meta / f"{t}_template_pair_label.txt", 3)
    if len(faces) != len(points):
        raise DataError(f"{meta}: {len(faces)} faces in {t}_face_tid_mid.txt but "
                        f"{len(points)} in {t}_name_5pts_score.txt")
    for i, (f, p) in enumerate(zip(faces, points, strict=True), 1):
        if f[0] != p[0]:
            raise DataError(f"{meta / f'{t}_name_5pts_score.txt'}:{i}: image {p[0]!r} but "
                            f"{t}_face_tid_mid.txt line {i} names {f[0]!r}")
    try:
        ints = np.array([r[1:] for r in faces], dtype=np.int64).reshape(-1, 2)
        floats = np.array([r[1:] for r in points], dtype=np.float64).reshape(-1, 11)
        pair_ints = np.array(pairs, dtype=np.int64).reshape(-1, 3)
    except ValueError as exc:
        raise DataError(f"{meta}: non-numeric field in the {t} meta files ({exc})") from exc
    return IJBMeta(
        root=root, names=[r[0] for r in faces], templates=ints[:, 0], medias=ints[:, 1],
        landmarks=floats[:, :10].reshape(-1, 5, 2), face_scores=floats[:, 10],
        t1=pair_ints[:, 0], t2=pair_ints[:, 1], labels=pair_ints[:, 2],
    )


def align_face(image: np.ndarray, landmarks: np.ndarray, size: int = 112) -> np.ndarray:
    """uint8 ``[H, W, 3]`` loose crop + ``[5, 2]`` (x, y) landmarks -> uint8 ``[size, size, 3]``."""
    reference = ARCFACE_REFERENCE * (size / 112.0)
    tform = SimilarityTransform.from_estimate(np.asarray(landmarks, np.float64), reference)
    if not tform:
        raise DataError(f"cannot fit a similarity transform to landmarks {landmarks.tolist()}")
    out = warp(image, tform.inverse, output_shape=(size, size), order=1, mode="constant",
               cval=0.0, preserve_range=True)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def iter_aligned_faces(meta: IJBMeta, batch_size: int = 256) -> Iterator[np.ndarray]:
    """Aligned faces of ``meta`` in file order, uint8 ``[B, 3, 112, 112]`` batches."""
    batch = []
    for name, lmk in zip(meta.names, meta.landmarks, strict=True):
        path = meta.root / "loose_crop" / name
        try:
            with Image.open(path) as im:
                rgb = np.asarray(im.convert("RGB"))
        except (OSError, ValueError) as exc:
            raise DataError(f"{path}: cannot read IJB image ({exc})") from exc
        batch.append(align_face(rgb, lmk).transpose(2, 0, 1))
        if len(batch) == batch_size:
            yield np.stack(batch)
            batch = []
    if batch:
        yield np.stack(batch)
