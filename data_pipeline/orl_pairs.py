"""An open-set verification set from the AT&T/ORL faces, written as an insightface ``.bin``.

Identities 31-40 (folders ``s31`` .. ``s40``, images ``1.pgm`` .. ``10.pgm``) are held
out of training (which uses 1-30), so every pair below is of people the network has
never seen. Pairs: all 45 genuine pairs within each identity (450 for ten identities)
and ``num_impostor_pairs`` impostor pairs drawn without replacement, with a seeded
generator, from all image pairs of different identities (4 500 for ten identities).
The pair order is a seeded permutation, so the 10 consecutive folds of the accuracy
protocol each mix genuine and impostor pairs. Images are stored as the training
shards store them (``codec.prepare_jpeg``: stretched from 92x112 to 112x112, JPEG q95).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from data_pipeline.codec import prepare_jpeg, read_image_file
from data_pipeline.errors import DataError
from data_pipeline.orl import find_orl_root
from data_pipeline.verification_bin import write_bin

IMAGES_PER_IDENTITY = 10


def orl_pairs(identities: Iterable[int], num_impostor_pairs: int,
              seed: int = 0) -> list[tuple[tuple[int, int], tuple[int, int], bool]]:
    """``[((identity, image), (identity, image), issame), ...]`` in the order written.

    Image numbers are 1..10 (``<image>.pgm``). Raises DataError when more impostor
    pairs are asked for than exist.
    """
    faces = [(i, k) for i in identities for k in range(1, IMAGES_PER_IDENTITY + 1)]
    genuine, impostor = [], []
    for a, b in itertools.combinations(faces, 2):
        (genuine if a[0] == b[0] else impostor).append((a, b, a[0] == b[0]))
    if not 0 <= num_impostor_pairs <= len(impostor):
        raise DataError(f"num_impostor_pairs={num_impostor_pairs}: between 0 and "
                        f"{len(impostor)} for these identities")
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(impostor), size=num_impostor_pairs, replace=False)
    pairs = genuine + [impostor[j] for j in np.sort(chosen)]
    return [pairs[j] for j in rng.permutation(len(pairs))]


def write_orl_verification_bin(out_path: str | os.PathLike,
                               identities: Iterable[int] = range(31, 41),
                               num_impostor_pairs: int = 450, seed: int = 0) -> Path:
    """Write the ORL open-set pairs to ``out_path`` (``read_bin``/``evaluate_bins`` format)."""
    identities = list(identities)
    root = find_orl_root()
    encoded: dict[tuple[int, int], bytes] = {}
    for i in identities:
        for k in range(1, IMAGES_PER_IDENTITY + 1):
            path = root / f"s{i}" / f"{k}.pgm"
            if not path.is_file():
                raise DataError(f"{path}: missing ORL image (identities are 1..40)")
            encoded[i, k] = prepare_jpeg(read_image_file(path, "ORL"), 112)
    images, issame = [], []
    for a, b, same in orl_pairs(identities, num_impostor_pairs, seed):
        images += [encoded[a], encoded[b]]
        issame.append(same)
    write_bin(out_path, images, issame)
    return Path(out_path)
