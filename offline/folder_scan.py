"""A converted folder's samples decoded and batched, each once, for the tools that embed a
whole training set (``offline.cleaning``, ``offline.overlap``): rank ``r`` of ``P`` reads the
shards ``r, r + P, ...``, of a local folder or of one at a URL (each shard copied to a
temporary file while it is read, data_pipeline.remote_shards.local_copy). Samples the training
loader would not train on are passed over here too: an undecodable image (the loader skips
it) and a label outside ``[0, num_classes)`` (the loader refuses it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
from tqdm import tqdm

from data_pipeline.codec import decode_image, resolve_decoder
from data_pipeline.errors import CorruptImageError
from data_pipeline.manifest import read_manifest
from data_pipeline.remote import open_folder
from data_pipeline.remote_shards import local_copy
from data_pipeline.tar_reader import tar_samples

Tag = TypeVar("Tag")


def decoded(encoded: Iterable[tuple[Tag, bytes]], decoder: str
            ) -> Iterator[tuple[Tag, np.ndarray]]:
    """(tag, CHW uint8 112x112 image) of each decodable blob; an undecodable one is passed
    over."""
    for tag, blob in encoded:
        try:
            yield tag, decode_image(blob, 112, decoder).transpose(2, 0, 1)
        except CorruptImageError:
            continue


def batched(items: Iterable[tuple[Tag, np.ndarray]], batch_size: int
            ) -> Iterator[tuple[list[Tag], np.ndarray]]:
    """(tags, images ``[B, 3, 112, 112]``) batches of :func:`decoded`'s output."""
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == batch_size:
            yield [t for t, _ in batch], np.stack([x for _, x in batch])
            batch = []
    if batch:
        yield [t for t, _ in batch], np.stack([x for _, x in batch])


def labelled_batches(data_dir: str | Path, batch_size: int, rank: int, world: int,
                     progress: str | None = None
                     ) -> Iterator[tuple[list[str], np.ndarray, np.ndarray]]:
    """``(keys, labels int64 [B], images uint8 [B, 3, 112, 112])`` of the shards
    ``rank::world`` of a converted folder (a path or a URL). ``progress``: the description of
    a bar over this rank's shards (None: no bar)."""
    folder = open_folder(data_dir)
    manifest = read_manifest(folder)

    def labelled() -> Iterator[tuple[tuple[str, int], bytes]]:
        for shard in tqdm(manifest.shards[rank::world], desc=progress, unit="shard",
                          disable=progress is None):
            with local_copy(folder, shard.name, shard.bytes) as path:
                for sample in tar_samples(path, exts=("jpg", "cls")):
                    try:
                        label = int(sample.get("cls", b"-1"))
                    except ValueError:
                        continue
                    if "jpg" in sample and 0 <= label < manifest.num_classes:
                        yield (sample["__key__"], label), sample["jpg"]

    for tags, images in batched(decoded(labelled(), resolve_decoder("auto")), batch_size):
        keys, labels = zip(*tags, strict=True)
        yield list(keys), np.asarray(labels, dtype=np.int64), images
