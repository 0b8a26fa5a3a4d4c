"""A small learnable face-free data set for smoke runs and trainer tests.

Each identity c is a smooth random colour field (a 4x4 grid of random colours, bicubically
upsampled) with a disc of its own colour, position and radius: classes differ at low
frequency, so a tiny CNN separates them in a few hundred CPU steps. Each image of the
identity is a random 112x112 crop of the 128x128 class canvas (+-8 px jitter), a random
brightness gain in [0.75, 1.25] and Gaussian pixel noise (sigma ``noise``, 10 by default),
JPEG quality 90, so the task is not a lookup. Everything derives from (seed, class, image):
the same call writes byte-identical shards.
"""

from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image

from data_pipeline.identities import Identities, numbered
from data_pipeline.manifest import Manifest
from data_pipeline.writer import DEFAULT_SAMPLES_PER_SHARD, write_dataset

SIZE = 112
CANVAS = 128


def class_canvas(seed: int, label: int) -> np.ndarray:
    """The 128x128x3 float pattern of identity `label`."""
    rng = np.random.default_rng([seed, label, 0])
    grid = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    canvas = np.asarray(Image.fromarray(grid).resize((CANVAS, CANVAS), Image.BICUBIC), np.float32)
    cy, cx = rng.uniform(0.25 * CANVAS, 0.75 * CANVAS, size=2)
    radius = rng.uniform(0.12 * CANVAS, 0.25 * CANVAS)
    yy, xx = np.mgrid[:CANVAS, :CANVAS]
    disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= radius**2
    canvas[disc] = rng.integers(0, 256, size=3)
    return canvas


class SyntheticSource:
    """`Source` (see writer.py) of num_classes x images_per_class generated JPEGs."""

    def __init__(self, num_classes: int, images_per_class: int, seed: int = 0,
                 noise: float = 10.0):
        if num_classes < 1 or images_per_class < 1 or noise < 0:
            raise ValueError(f"num_classes={num_classes}, images_per_class={images_per_class}, "
                             f"noise={noise}: the counts must be >= 1, the noise >= 0")
        self.num_classes, self.images_per_class, self.seed = num_classes, images_per_class, seed
        self.noise = noise

    def __len__(self) -> int:
        return self.num_classes * self.images_per_class

    def describe(self) -> dict:
        # the noise only where it is not the default, so that sets written before it stay
        # the same conversion (the description is part of a resume's fingerprint)
        return {"type": "synthetic", "num_classes": self.num_classes,
                "images_per_class": self.images_per_class, "seed": self.seed,
                **({"noise": self.noise} if self.noise != 10.0 else {})}

    def identity_map(self) -> Identities:
        return numbered(self.num_classes, "the labels (synthetic identities have no names)")

    def read(self, index: int) -> tuple[bytes, int, str]:
        label, image = divmod(index, self.images_per_class)
        rng = np.random.default_rng([self.seed, label, image + 1])
        y, x = rng.integers(0, CANVAS - SIZE + 1, size=2)
        crop = class_canvas(self.seed, label)[y:y + SIZE, x:x + SIZE]
        crop = crop * rng.uniform(0.75, 1.25) + rng.normal(0.0, self.noise, size=crop.shape)
        out = io.BytesIO()
        Image.fromarray(np.clip(crop, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
        return out.getvalue(), label, f"{label}/{image}"


def write_synthetic_dataset(out_dir: str | os.PathLike, num_classes: int, images_per_class: int,
                            seed: int = 0,
                            samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD) -> Manifest:
    """Write the synthetic set as shards + manifest (resumable like any conversion)."""
    manifest, _ = write_dataset(SyntheticSource(num_classes, images_per_class, seed), out_dir,
                                size=SIZE, samples_per_shard=samples_per_shard,
                                shuffle_seed=seed)
    return manifest


class MislabelledSource(SyntheticSource):
    """The synthetic set with label noise planted, for testing data cleaning
    (``python -m launch.clean``): every ``every``-th item (``index % every == every // 3``)
    shows another identity's image under its own label, one such per ``every`` images, as
    web-crawled sets file images under the wrong identity. ``planted``: those items' indices
    (written with ``shuffle_seed=None`` their keys are ``f"{index:09d}"``)."""

    def __init__(self, num_classes: int, images_per_class: int, seed: int = 0,
                 every: int = 10):
        super().__init__(num_classes, images_per_class, seed)
        if num_classes < 2 or every < 2:
            raise ValueError(f"num_classes={num_classes}, every={every}: both must be >= 2")
        self.every = every
        self.planted = frozenset(range(every // 3, len(self), every))

    def describe(self) -> dict:
        return {**super().describe(), "type": "synthetic-mislabelled", "every": self.every}

    def read(self, index: int) -> tuple[bytes, int, str]:
        label, image = divmod(index, self.images_per_class)
        if index not in self.planted:
            return super().read(index)
        other = (label + 1 + index % (self.num_classes - 1)) % self.num_classes
        data, _, src = super().read(other * self.images_per_class + image)
        return data, label, src
