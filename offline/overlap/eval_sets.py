"""The evaluation sets ``launch.overlap`` compares training identities with, each as its
distinct images, named and loaded by index, in the form ``launch.evaluate`` reads them:
verification ``.bin`` files (LFW, CFP-FP, AgeDB, ...), RFW per group as a ``.bin`` or from its
released folder of images and pair lists (RFW is drawn from MS-Celeb-1M, so it shares
identities with MS1M training sets), IJB-B/C's ``IJB_release`` folder (faces aligned from their
landmarks) and TinyFace's ``Testing_Set`` (probes, matched gallery and distractors, stretched
to 112x112 as evaluation does). Of a set of pairs only its distinct images are searched: the
threshold is calibrated on the training folder (``offline.overlap.calibration``), not on a set's
impostor pairs.

An image's name says where to find it: ``lfw.bin[123]`` (its first position among the .bin's
images), ``data/African/m.0abc/m.0abc_0001.jpg`` (RFW's folder), ``loose_crop/1234.jpg``
(IJB), ``Probe/1_1.jpg`` (TinyFace).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_pipeline.codec import read_image_file, resolve_decoder
from offline.folder_scan import decoded

Loader = Callable[[list[int]], tuple[list[int], np.ndarray]]


@dataclass(frozen=True)
class EvalImages:
    """One evaluation set: ``names[i]`` of each distinct image ``i``; ``load(indices)`` gives
    the indices it could decode and their images, uint8 ``[k, 3, 112, 112]``."""

    name: str
    names: tuple[str, ...]
    load: Loader

    def share(self, rank: int, world: int, batch_size: int
              ) -> Iterator[tuple[list[int], np.ndarray]]:
        """Rank ``rank``'s images (``rank, rank + world, ...``) in batches."""
        return self.batches(list(range(rank, len(self.names), world)), batch_size)

    def batches(self, indices: list[int], batch_size: int
                ) -> Iterator[tuple[list[int], np.ndarray]]:
        """The images at ``indices`` that decode, in batches."""
        for start in range(0, len(indices), batch_size):
            found, images = self.load(indices[start:start + batch_size])
            if found:
                yield found, images


def _encoded_loader(blob: Callable[[int], bytes]) -> Loader:
    """Decode image ``i``'s bytes ``blob(i)`` (stretched to 112x112, as evaluation decodes
    them); an undecodable one is left out."""

    def load(indices: list[int]) -> tuple[list[int], np.ndarray]:
        found = list(decoded(((i, blob(i)) for i in indices), resolve_decoder("auto")))
        return [i for i, _ in found], np.stack([x for _, x in found]) if found else None

    return load


def bin_images(name: str, path: str | Path, encoded: list[bytes]) -> EvalImages:
    """A ``.bin``'s distinct images (``encoded``: all 2P of them, as read_bin gives them)."""
    first: dict[bytes, int] = {}
    for i, blob in enumerate(encoded):
        first.setdefault(blob, i)
    return EvalImages(name, tuple(f"{Path(path).name}[{i}]" for i in first.values()),
                      _encoded_loader(list(first).__getitem__))


def bin_set(name: str, path: Path) -> EvalImages:
    """A verification ``.bin``'s distinct images (LFW, CFP-FP, ..., one RFW group)."""
    from data_pipeline.verification_bin import read_bin

    return bin_images(name, path, read_bin(path)[0])


def rfw_folder_images(root: Path, group: str) -> EvalImages:
    """One RFW group from the released folder (``data_pipeline.rfw``: ``root`` holds
    ``txts/`` and ``data/``), its images named by their path under ``root``."""
    from data_pipeline.rfw import read_rfw_pairs

    pairs = read_rfw_pairs(root, group)
    distinct = list(dict.fromkeys(p for pair in zip(pairs.first, pairs.second, strict=True)
                                  for p in pair))
    blobs = {path: read_image_file(path, "RFW") for path in distinct}
    return EvalImages(f"RFW/{group}", tuple(p.relative_to(root).as_posix() for p in distinct),
                      _encoded_loader(lambda i: blobs[distinct[i]]))


def ijb_images(root: str | Path, target: str) -> EvalImages:
    """IJB-B/C's faces (``data_pipeline.ijb``), aligned as evaluation aligns them."""
    from data_pipeline.ijb import aligned_face, read_ijb_meta

    meta = read_ijb_meta(root, target)

    def load(indices: list[int]) -> tuple[list[int], np.ndarray]:
        return indices, np.stack([aligned_face(meta, i) for i in indices])

    return EvalImages(target, tuple(f"loose_crop/{n}" for n in meta.names), load)


def tinyface_images(root: str | Path) -> EvalImages:
    """TinyFace's probes, matched gallery and distractors (``data_pipeline.tinyface``)."""
    from data_pipeline.tinyface import read_tinyface

    lists = read_tinyface(root)
    paths = list(dict.fromkeys(lists.probe_paths + lists.gallery_paths))
    return EvalImages("TinyFace", tuple(f"{p.parent.name}/{p.name}" for p in paths),
                      _encoded_loader(lambda i: read_image_file(paths[i], "TinyFace")))
