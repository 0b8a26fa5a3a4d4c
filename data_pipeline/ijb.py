"""Read the insightface ``IJB_release`` layout and align its faces to 112x112.

Layout (``T`` = ``IJBB`` or ``IJBC``, ``t`` its lower case)::

    ROOT/meta/t_face_tid_mid.txt          "<image> <template id> <media id>" per face
    ROOT/meta/t_template_pair_label.txt   "<template 1> <template 2> <1 same | 0 different>"
    ROOT/meta/t_name_5pts_score.txt       "<image> x1 y1 ... x5 y5 <detector score>"
    ROOT/loose_crop/<image>

    ROOT/meta/t_1N_gallery_G1.csv         1:N (IJBC; IJBB: ..._S1.csv): a header line, then
    ROOT/meta/t_1N_gallery_G2.csv         "<template id>,<subject id>[,...]" per row
    ROOT/meta/t_1N_probe_mixed.csv        (IJBB: ..._S2.csv), read only for 1:N

``ROOT`` is the folder holding ``meta/`` (``IJB_release/IJBC``); ``IJB_release`` itself
is accepted too. The two per-face files must list the same images in the same order.

Alignment, as insightface's ``recognition/arcface_torch/eval_ijbc.py`` does it: the
similarity transform (rotation, uniform scale, translation) that maps the 5 detected
landmarks onto ArcFace's 112x112 reference points in the least-squares sense (Umeyama),
fitted by scikit-image on float32 landmarks and float32 reference points, then applied
with OpenCV's ``warpAffine`` (bilinear, black outside the crop). OpenCV's warp is
fixed-point: it rounds source coordinates to 1/32 px and interpolation weights to
1/1024, so a float warp (scikit-image's) differs by up to a few grey levels, and the
float64 fit moves the transform by ~1e-5 px; either alone moves IJB pair scores by
~1e-4 (bench/ijb_equivalence.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
from skimage.transform import SimilarityTransform

from data_pipeline.codec import decode_rgb, read_image_file
from data_pipeline.door import read_text
from data_pipeline.errors import CorruptImageError, DataError

# ArcFace 112x112 reference landmarks (eyes, nose tip, mouth corners), x then y: the
# 96x112 points of SphereFace/insightface shifted right by 8 pixels, in float32 and
# shifted in float32 as eval_ijbc.py builds them (float32(30.2946) + 8 is not
# float32(38.2946): the two differ by 7.6e-6).
ARCFACE_REFERENCE = np.array(
    [[30.2946, 51.6963], [65.5318, 51.5014], [48.0252, 71.7366],
     [33.5493, 92.3655], [62.7299, 92.2041]], dtype=np.float32)
ARCFACE_REFERENCE[:, 0] += np.float32(8.0)
TARGETS = ("IJBB", "IJBC")
MAX_META_BYTES = 512 << 20  # IJB-C's pair list, the largest, is ~250 MB (15.7 M pairs)


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
    text = read_text(path, "an IJB meta file", limit=MAX_META_BYTES)
    rows = [line.split() for line in text.splitlines() if line.strip()]
    for i, row in enumerate(rows, 1):
        if width is not None and len(row) != width:
            raise DataError(f"{path}:{i}: expected {width} fields, got {len(row)}")
    return rows


def _target_root(root: str | os.PathLike, target: str) -> Path:
    """The folder holding ``meta/``: ``root`` or ``root/target``."""
    if target not in TARGETS:
        raise DataError(f"ijb target {target!r}: choose one of {', '.join(TARGETS)}")
    root = Path(root)
    if not (root / "meta").is_dir() and (root / target / "meta").is_dir():
        root = root / target
    return root


def read_ijb_meta(root: str | os.PathLike, target: str = "IJBC") -> IJBMeta:
    """Parse the three meta files of ``target`` (``IJBB`` | ``IJBC``) under ``root``."""
    root = _target_root(root, target)
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
    except (ValueError, OverflowError) as exc:
        raise DataError(f"{meta}: non-numeric field in the {t} meta files "
                        f"({str(exc)[:120]})") from exc
    return IJBMeta(
        root=root, names=[r[0] for r in faces], templates=ints[:, 0], medias=ints[:, 1],
        landmarks=floats[:, :10].reshape(-1, 5, 2), face_scores=floats[:, 10],
        t1=pair_ints[:, 0], t2=pair_ints[:, 1], labels=pair_ints[:, 2],
    )


@dataclass(frozen=True)
class IJB1NMeta:
    """IJB 1:N lists: the distinct gallery templates (both galleries) and probe templates,
    each sorted, with its subject (the lists have a row per image, so ids repeat there)."""

    gallery_templates: np.ndarray  # [G] int64, sorted
    gallery_subjects: np.ndarray  # [G] int64
    probe_templates: np.ndarray  # [P] int64, sorted
    probe_subjects: np.ndarray  # [P] int64


def _template_subjects(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise DataError(f"{path}: missing (IJB 1:N needs the insightface IJB_release 1:N lists)")
    text = read_text(path, "an IJB 1:N list", limit=MAX_META_BYTES)
    rows = [line.split(",") for line in text.splitlines()[1:] if line.strip()]
    for i, row in enumerate(rows, 2):
        if len(row) < 2:
            raise DataError(f"{path}:{i}: expected '<template id>,<subject id>', got {row}")
    try:
        ints = np.array([r[:2] for r in rows], dtype=np.int64).reshape(-1, 2)
    except ValueError as exc:
        raise DataError(f"{path}: non-numeric template or subject id ({exc})") from exc
    return ints[:, 0], ints[:, 1]


def read_ijb_1n_meta(root: str | os.PathLike, target: str = "IJBC") -> IJB1NMeta:
    """The gallery and mixed-probe lists of ``target`` as insightface's ``ijb_1n.py`` reads
    them (G1/G2 for IJBC, S1/S2 for IJBB), under ``root`` as :func:`read_ijb_meta` takes it."""
    meta, t = _target_root(root, target) / "meta", target.lower()
    galleries = ("G1", "G2") if target == "IJBC" else ("S1", "S2")
    parts = [_template_subjects(meta / f"{t}_1N_gallery_{g}.csv") for g in galleries]
    gallery = _distinct(np.concatenate([p[0] for p in parts]),
                        np.concatenate([p[1] for p in parts]))
    probes = _distinct(*_template_subjects(meta / f"{t}_1N_probe_mixed.csv"))
    return IJB1NMeta(*gallery, *probes)


def _distinct(templates: np.ndarray, subjects: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct templates and the subject of each one's first row (ijb_1n.py's
    ``np.unique(..., return_index=True)``)."""
    unique, first = np.unique(templates, return_index=True)
    return unique, subjects[first]


def align_face(image: np.ndarray, landmarks: np.ndarray, size: int = 112) -> np.ndarray:
    """uint8 ``[H, W, 3]`` loose crop + ``[5, 2]`` (x, y) landmarks -> uint8 ``[size, size, 3]``.

    The landmarks are cast to float32 first, as eval_ijbc.py parses them.
    """
    reference = ARCFACE_REFERENCE * np.float32(size / 112.0)
    tform = SimilarityTransform.from_estimate(np.asarray(landmarks, np.float32), reference)
    if not tform:
        raise DataError(f"cannot fit a similarity transform to landmarks {landmarks.tolist()}")
    return cv2.warpAffine(np.ascontiguousarray(image), tform.params[:2], (size, size),
                          borderValue=0.0)


def aligned_face(meta: IJBMeta, index: int) -> np.ndarray:
    """Face ``index`` of ``meta`` aligned, uint8 ``[3, 112, 112]``."""
    path = meta.root / "loose_crop" / meta.names[index]
    try:  # PIL, as before the pixel limit: its pixels are what bench/ijb_equivalence.py checks
        rgb = decode_rgb(read_image_file(path, "IJB"), "pil")
    except CorruptImageError as exc:
        raise DataError(f"{path}: cannot read IJB image ({exc})") from exc
    return align_face(rgb, meta.landmarks[index]).transpose(2, 0, 1)


def iter_aligned_faces(meta: IJBMeta, batch_size: int = 256) -> Iterator[np.ndarray]:
    """Aligned faces of ``meta`` in file order, uint8 ``[B, 3, 112, 112]`` batches."""
    batch = []
    for index in range(len(meta.names)):
        batch.append(aligned_face(meta, index))
        if len(batch) == batch_size:
            yield np.stack(batch)
            batch = []
    if batch:
        yield np.stack(batch)
