"""Shard writing: manifest, atomic and resumable conversion, the synthetic data set."""

import io
import json
import tarfile

import numpy as np
import pytest
from PIL import Image

from data_pipeline import read_manifest, write_dataset, write_synthetic_dataset
from data_pipeline.errors import DataError, ShardError
from data_pipeline.shard_index import index_path, read_index
from data_pipeline.synthetic import SyntheticSource
from data_pipeline.tar_reader import tar_samples
from data_pipeline.writer import PROGRESS_NAME


class Crash(Exception):
    pass


class CrashingSource(SyntheticSource):
    """Synthetic source that dies on one read, like a killed conversion."""

    def __init__(self, crash_at: int | None):
        super().__init__(num_classes=5, images_per_class=6, seed=3)
        self.crash_at = crash_at

    def read(self, index):
        if index == self.crash_at:
            raise Crash
        return super().read(index)


def shard_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard-*.tar"))}


def test_manifest_and_shard_contents(tmp_path):
    manifest = write_synthetic_dataset(tmp_path, num_classes=4, images_per_class=5, seed=1,
                                       samples_per_shard=6)
    assert manifest == read_manifest(tmp_path)
    assert (manifest.num_classes, manifest.num_samples) == (4, 20)
    assert manifest.shard_counts == [6, 6, 6, 2]
    assert manifest.source["type"] == "synthetic" and manifest.source["samples_per_shard"] == 6
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert [s["name"] for s in raw["shards"]] == [f"shard-{i:06d}.tar" for i in range(4)]
    keys, labels = [], []
    for shard in manifest.shards:
        assert (tmp_path / shard.name).stat().st_size == shard.bytes
        for sample in tar_samples(tmp_path / shard.name):
            assert set(sample) == {"__key__", "jpg", "cls", "src"}
            assert sample["jpg"][:3] == b"\xff\xd8\xff"
            keys.append(sample["__key__"])
            labels.append(int(sample["cls"]))
    assert keys == [f"{i:09d}" for i in range(20)]
    assert sorted(labels) == sorted(list(range(4)) * 5)
    assert labels != sorted(labels)  # written in a seeded random order
    assert not list(tmp_path.glob("*.tmp")) and not (tmp_path / PROGRESS_NAME).exists()


def test_crash_then_resume_equals_uninterrupted(tmp_path):
    reference = tmp_path / "ref"
    write_dataset(CrashingSource(None), reference, samples_per_shard=7)
    order = np.random.default_rng(0).permutation(30)
    crashed = tmp_path / "crashed"
    with pytest.raises(Crash):  # dies while writing shard 2 (positions 14..20)
        write_dataset(CrashingSource(int(order[16])), crashed, samples_per_shard=7)
    assert sorted(p.name for p in crashed.iterdir()) == [
        PROGRESS_NAME, "shard-000000.tar", "shard-000000.tar.idx", "shard-000001.tar",
        "shard-000001.tar.idx", "shard-000002.tar.tmp"]
    index_path(crashed / "shard-000001.tar").unlink()  # as if stopped before that index
    with pytest.raises(DataError, match="manifest"):
        read_manifest(crashed)
    with pytest.raises(DataError, match="unfinished conversion with other settings"):
        write_dataset(CrashingSource(None), crashed, samples_per_shard=8)
    # another pixel limit would store the rest re-encoded under other rules: refused, naming it
    with pytest.raises(DataError, match=r"settings \(max_pixels 50000000 -> 10000\)") as refused:
        write_dataset(CrashingSource(None), crashed, samples_per_shard=7, max_pixels=10_000)
    assert "\n" not in str(refused.value)
    before = (crashed / "shard-000000.tar").stat().st_mtime_ns
    manifest, corrupt = write_dataset(CrashingSource(None), crashed, samples_per_shard=7)
    assert corrupt == [] and (crashed / "shard-000000.tar").stat().st_mtime_ns == before
    assert shard_bytes(crashed) == shard_bytes(reference)
    assert manifest == read_manifest(reference)
    for shard in manifest.shards:  # every shard indexed, as in the uninterrupted folder
        got, want = read_index(crashed / shard.name), read_index(reference / shard.name)
        assert got.keys.tolist() == want.keys.tolist()
        assert np.array_equal(got.members, want.members)
    # a finished folder: same settings -> nothing to do; other settings -> refused
    assert write_dataset(CrashingSource(None), crashed, samples_per_shard=7)[0] == manifest
    with pytest.raises(DataError, match="already holds a different conversion"):
        write_dataset(CrashingSource(None), crashed, samples_per_shard=5)


def test_synthetic_is_deterministic_and_learnable(tmp_path):
    write_synthetic_dataset(tmp_path / "a", 6, 4, seed=7, samples_per_shard=10)
    write_synthetic_dataset(tmp_path / "b", 6, 4, seed=7, samples_per_shard=10)
    write_synthetic_dataset(tmp_path / "c", 6, 4, seed=8, samples_per_shard=10)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")
    assert shard_bytes(tmp_path / "a") != shard_bytes(tmp_path / "c")
    # learnable: nearest class centroid of 16x16 thumbnails separates 30 classes on held-out
    # images; not trivial: images of one class are not identical
    source = SyntheticSource(30, 8, seed=0)

    def thumb(i):
        return np.asarray(Image.open(io.BytesIO(source.read(i)[0])).resize((16, 16)), float).ravel()

    feats = np.stack([thumb(i) for i in range(len(source))]).reshape(30, 8, -1)
    centroids = feats[:, :4].mean(1)
    held_out = feats[:, 4:].reshape(-1, feats.shape[-1])
    predicted = np.argmin(((held_out[:, None] - centroids[None]) ** 2).sum(-1), axis=1)
    assert (predicted == np.repeat(np.arange(30), 4)).mean() > 0.9
    assert np.abs(feats[:, 0] - feats[:, 1]).mean() > 5


def test_bad_inputs(tmp_path):
    with pytest.raises(DataError, match="samples_per_shard=0"):
        write_synthetic_dataset(tmp_path / "x", 2, 2, samples_per_shard=0)
    with pytest.raises(DataError, match="size=-1"):
        write_dataset(SyntheticSource(num_classes=2, images_per_class=2), tmp_path / "z", size=-1)
    assert not (tmp_path / "z").exists()
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "shard-000000.tar").write_bytes(b"")
    with pytest.raises(DataError, match="holds shards but no"):
        write_synthetic_dataset(tmp_path / "y", 2, 2)


def test_shard_reader_accepts_tarfile_archives_and_rejects_bad_headers(tmp_path):
    path = tmp_path / "other.tar"
    with tarfile.open(path, "w") as tar:  # Python's default (pax) format, a sub-folder
        for name, payload in [("d/a.jpg", b"A" * 700), ("d/a.cls", b"1"), ("d/b.jpg", b"B"),
                              ("d/b.cls", b"2"), ("c.cls", b"3")]:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    samples = list(tar_samples(path))
    assert [s["__key__"] for s in samples] == ["d/a", "d/b", "c"]
    assert samples[0]["jpg"] == b"A" * 700 and samples[1]["cls"] == b"2"
    assert [s["__key__"] for s in tar_samples(path, 1, 2)] == ["d/b"]
    data = bytearray(path.read_bytes())
    data[512 + 1024 + 10] ^= 0xFF  # inside the second header (after 700 bytes of data)
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"other\.tar: corrupt tar header at byte 1536"):
        list(tar_samples(path))
