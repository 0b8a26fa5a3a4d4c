"""Fuzzing a converted folder through the training loader (``make_loader``, in this process,
``num_workers=0``: the same stages a worker runs): whatever a shard, its member index,
``manifest.json`` or ``identities.json`` holds, an epoch ends with every bad sample skipped and
counted (``num_skipped``) or with a one-line DataError (a shard that does not match its
manifest or index is refused), within the bounds of tests/fuzz/bounds.py.

Seeds: a folder of one 6-sample shard; the issue's JPEG stored as a sample; the shard damaged
at its own size (flipped bits, huge sizes in tar headers, random bytes: the manifest's byte
count still matches) or truncated at every 512-byte block and a sample of other boundaries;
damaged indexes, manifests (wrong types, deep nesting, huge counts) and identity maps.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from data_pipeline import make_loader
from data_pipeline.errors import DataError
from data_pipeline.identities import numbered, read_identities
from data_pipeline.manifest import read_manifest
from data_pipeline.tar_reader import BLOCK, tar_samples
from data_pipeline.writer import write_dataset
from tests.fuzz.bounds import BOMB, damaged, face, figures, fuzz_settings, json_documents, one_line

SHARD = "shard-000000.tar"


class Faces:
    """A converter source of the given images, labels alternating 0 and 1."""

    num_classes = 2

    def __init__(self, images: list[bytes]):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def describe(self) -> dict:
        return {"type": "fuzz", "images": len(self.images)}

    def identity_map(self):
        return numbered(2, "fuzz")

    def read(self, index: int) -> tuple[bytes, int, str]:
        return self.images[index], index % 2, f"img{index}"


def write_folder(out: Path, images: list[bytes]) -> Path:
    write_dataset(Faces(images), out, size=None, samples_per_shard=len(images),
                  shuffle_seed=None)
    return out


def one_epoch(folder: Path) -> tuple[int, int]:
    """(images handed out, samples skipped) of one epoch, as the trainer reads it; the
    identity map read as the trainer reads it too."""
    loader = make_loader(folder, batch_size=2, num_workers=0, shuffle_buffer=4, seed=0)
    read_identities(folder, read_manifest(folder))
    handed = sum(len(batch[1]) for batch in loader)
    return handed, loader.num_skipped


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("faces"), [face("JPEG", 112)] * 6)


@pytest.fixture(scope="module")
def shard_figures():
    with figures("shard: make_loader over a folder (shard, index, manifest, identities)") as t:
        yield t


def _epoch_with(tracked, folder: Path, name: str, data: bytes) -> None:
    """One epoch over a copy of ``folder`` whose file ``name`` holds ``data``."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(shutil.copytree(folder, Path(tmp) / "f"))
        (copy / name).write_bytes(data)
        value, error = tracked.measure(lambda: one_epoch(copy))
    if error is not None:
        one_line(error, (DataError,))
        tracked.count(f"{name}: refused")
    else:
        tracked.count(f"{name}: skipped {value[1]}")


def test_the_issue_jpeg_in_a_shard_is_skipped_and_counted(tmp_path, shard_figures):
    """Before the pixel limit this epoch took 10.5 GB and 31 s; now the sample is corrupt."""
    folder = write_folder(tmp_path / "f", [face("JPEG", 112)] * 3 + [BOMB])
    (handed, skipped), error = shard_figures.measure(lambda: one_epoch(folder))
    assert error is None and skipped == 1 and handed == 4  # 2 batches, the last padded
    assert shard_figures.last[0] < 1.0 and shard_figures.last[1] < 64 << 20


@pytest.mark.parametrize("limit, skipped", [(None, 0), (200 * 200 - 1, 1)])
def test_data_max_pixels_reaches_the_trainers_loader(tmp_path, limit, skipped):
    """``data.max_pixels`` is the loader's limit: a 200 x 200 sample is read under the
    default and skipped and counted one pixel below its size (decode_into's fast path
    takes only what fits 112 x 112, so the header check decides)."""
    import torch
    from launch_helpers import make_config

    from trainer.build import build_loader
    from trainer.dist import DistEnv

    folder = write_folder(tmp_path / "f", [face("JPEG", 112)] * 3 + [face("JPEG", 200)])
    given = [] if limit is None else [f"data.max_pixels={limit}"]
    cfg = make_config(f"data.dir={folder}", "data.num_classes=2", "data.num_workers=0",
                      "train.batch_size=2", *given)
    loader = build_loader(cfg, DistEnv(0, 1, 0, torch.device("cpu")))
    assert sum(len(batch[1]) for batch in loader) == 4 and loader.num_skipped == skipped


def test_a_shard_truncated_at_every_block(folder, shard_figures):
    """The tar reader every other reader goes through, at each 512-byte boundary: a
    one-line ShardError, or every sample when only the zero padding after the archive's end
    was cut (the loader refuses the size mismatch before reading)."""
    data = (folder / SHARD).read_bytes()
    for end in range(0, len(data), BLOCK):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / SHARD
            path.write_bytes(data[:end])
            samples, error = shard_figures.measure(lambda p=path: list(tar_samples(p)))
        if error is None:
            assert len(samples) == 6
        else:
            one_line(error, (DataError,))


@fuzz_settings(examples=12)
@given(data=st.data())
def test_damaged_folders(folder, shard_figures, data):
    name = data.draw(st.sampled_from([SHARD, SHARD, SHARD + ".idx", "manifest.json",
                                      "identities.json"]))
    original = (folder / name).read_bytes()
    if name.endswith(".json"):
        blob = data.draw(json_documents(json.loads(original)))
    else:
        blob = data.draw(damaged(original, keep_size=name == SHARD))
    _epoch_with(shard_figures, folder, name, blob)
