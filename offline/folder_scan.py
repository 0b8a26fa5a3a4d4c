"""A converted folder's samples decoded and batched, each once, for the tools that embed a
whole training set (``offline.cleaning``, ``offline.overlap``): rank ``r`` of ``P`` reads the
shards ``r, r + P, ...``. Samples the training loader would not train on are passed over here
too: an undecodable image (the loader skips it) and a label outside ``[0, num_classes)`` (the
loader refuses it).

The folder may be a URL (``s3://``, ``https://``, ``file://``: data_pipeline.remote, the
client layer training reads through). A remote shard is fetched whole, in one request (with
that layer's retries), checked against the manifest's size and parsed in memory: these
tools read every sample of a shard once, so nothing is gained by the loader's ranged reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
from tqdm import tqdm

from data_pipeline.codec import decode_image, resolve_decoder
from data_pipeline.errors import CorruptImageError, ShardError
from data_pipeline.manifest import ShardInfo, read_manifest
from data_pipeline.remote import RemoteFolder, open_folder
from data_pipeline.tar_reader import sample_members, tar_samples

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


def labelled_samples(data_dir: str | Path, rank: int, world: int,
                     exts: tuple[str, ...] = ("jpg", "cls"), progress: str | None = None
                     ) -> Iterator[tuple[int, dict]]:
    """``(label, sample)`` of each sample with an image and a label in ``[0, num_classes)``
    in the shards ``rank::world`` of a converted folder (a path or a URL); ``sample`` holds
    ``__key__`` and the members named in ``exts`` (``src``: the source path the converter
    stored). ``progress``: the description of a bar over this rank's shards (None: no bar)."""
    folder = open_folder(data_dir)
    manifest = read_manifest(folder)
    for shard in tqdm(manifest.shards[rank::world], desc=progress, unit="shard",
                      disable=progress is None):
        samples = (tar_samples(folder / shard.name, exts=exts) if isinstance(folder, Path)
                   else _fetched_samples(folder, shard, exts))
        for sample in samples:
            try:
                label = int(sample.get("cls", b"-1"))
            except ValueError:
                continue
            if "jpg" in sample and 0 <= label < manifest.num_classes:
                yield label, sample


def _fetched_samples(folder: RemoteFolder, shard: ShardInfo, exts: tuple[str, ...]
                     ) -> Iterator[dict]:
    """The samples of a remote shard, fetched whole (one request, retried as
    data_pipeline.remote does) and parsed in memory."""
    where = f"{folder.shown}/{shard.name}"
    data = folder.read(shard.name)
    if len(data) != shard.bytes:
        raise ShardError(f"{where}: {len(data)} bytes stored, manifest says {shard.bytes} "
                         "(truncated or rewritten shard)")
    for key, members in sample_members(data, where):
        yield {"__key__": key, **{ext: data[offset:offset + size]
                                  for ext, offset, size in members if ext in exts}}


def labelled_batches(data_dir: str | Path, batch_size: int, rank: int, world: int,
                     progress: str | None = None
                     ) -> Iterator[tuple[list[str], np.ndarray, np.ndarray]]:
    """``(keys, labels int64 [B], images uint8 [B, 3, 112, 112])`` of the shards
    ``rank::world`` of a converted folder (a path or a URL), as :func:`labelled_samples`
    reads them."""
    tagged = (((sample["__key__"], label), sample["jpg"])
              for label, sample in labelled_samples(data_dir, rank, world, progress=progress))
    for tags, images in batched(decoded(tagged, resolve_decoder("auto")), batch_size):
        keys, labels = zip(*tags, strict=True)
        yield list(keys), np.asarray(labels, dtype=np.int64), images
