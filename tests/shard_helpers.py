"""Small hand-made shard folders for the loader tests: every label readable from its key
(``int(key) % num_classes``) and drawn into the image's left third (a flip is visible)."""

import io

import numpy as np
import torch
from PIL import Image

from data_pipeline.manifest import Manifest, write_manifest
from data_pipeline.writer import Sample, shard_name, write_shard


def jpeg(label: int, size=(112, 112)) -> bytes:
    image = np.zeros((size[1], size[0], 3), np.uint8)
    image[:, : size[0] // 3] = (40 * label) % 256  # left third marks the label (flip visible)
    out = io.BytesIO()
    Image.fromarray(image).save(out, "JPEG", quality=95)
    return out.getvalue()


def make_shards(folder, counts, corrupt=(), odd_size=(), num_classes=7):
    """Shards with per-shard `counts`; positions in `corrupt` get undecodable bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    infos, pos = [], 0
    for i, count in enumerate(counts):
        samples = []
        for _ in range(count):
            data = jpeg(pos % num_classes, (64, 80) if pos in odd_size else (112, 112))
            if pos in corrupt:
                data = data[:3] + b"garbage" * 20
            samples.append(Sample(f"{pos:09d}", data, pos % num_classes, str(pos)))
            pos += 1
        infos.append(write_shard(folder / shard_name(i), samples))
    write_manifest(folder, Manifest(num_classes=num_classes, num_samples=pos, shards=tuple(infos)))
    return folder


def epoch_keys(loader, num_classes=7):
    """The keys of one epoch of a ``with_keys`` loader, checking shapes and labels."""
    keys = []
    for images, labels, batch_keys in loader:
        assert images.shape == (loader.batch_size, 3, 112, 112) and images.dtype == torch.uint8
        assert labels.dtype == torch.int64
        assert labels.tolist() == [int(k) % num_classes for k in batch_keys]
        keys.extend(batch_keys)
    return keys
