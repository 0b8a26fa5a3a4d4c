"""`python -m launch.convert`: image folders to shards, verify, CLI errors."""

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data_pipeline import make_loader, read_manifest
from data_pipeline.errors import DataError
from data_pipeline.identities import IDENTITIES_NAME, read_identities
from data_pipeline.manifest import MANIFEST_NAME
from data_pipeline.tar_reader import tar_samples
from launch.convert import main

REPO = Path(__file__).resolve().parents[2]


def encoded(seed: int, size=(112, 112), fmt="JPEG", mode="RGB") -> bytes:
    """A smooth random image (JPEG keeps it close), encoded as `fmt`."""
    rng = np.random.default_rng(seed)
    grid = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).convert(mode)
    out = io.BytesIO()
    grid.resize(size, Image.BICUBIC).save(out, fmt)
    return out.getvalue()


@pytest.fixture
def image_folder(tmp_path):
    files = {
        "bob/1.jpg": encoded(1), "bob/2.jpg": encoded(2),
        "alice/a.png": encoded(3, fmt="PNG"), "alice/b.jpg": encoded(4, size=(92, 112)),
        "alice/notes.txt": b"not an image", "carol/gray.jpg": encoded(5, mode="L"),
        "carol/skip.jpg": encoded(6),
    }
    for rel, data in files.items():
        (tmp_path / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / rel).write_bytes(data)
    return tmp_path / "src", files


def stored(folder):
    out = {}
    for shard in read_manifest(folder).shards:
        for sample in tar_samples(folder / shard.name):
            out[sample["src"].decode()] = (sample["jpg"], int(sample["cls"]), sample["__key__"])
    return out


def test_imagefolder_round_trip(image_folder, tmp_path, capsys):
    src, files = image_folder
    out = tmp_path / "out"
    argv = ["imagefolder", str(src), str(out), "--samples-per-shard", "2", "--exclude",
            "carol/skip*"]
    assert main(argv) == 0
    manifest = read_manifest(out)
    assert (manifest.num_classes, manifest.num_samples, manifest.shard_counts) == (3, 5, [2, 2, 1])
    shards = stored(out)
    labels = {rel: label for rel, (_, label, _) in shards.items()}
    assert labels == {"alice/a.png": 0, "alice/b.jpg": 0, "bob/1.jpg": 1, "bob/2.jpg": 1,
                      "carol/gray.jpg": 2}  # folders sorted by name
    for rel in ("bob/1.jpg", "bob/2.jpg", "carol/gray.jpg"):  # 112x112 JPEG: kept verbatim
        assert shards[rel][0] == files[rel]
    for rel in ("alice/a.png", "alice/b.jpg"):  # re-encoded at 112x112
        assert shards[rel][0][:3] == b"\xff\xd8\xff" and shards[rel][0] != files[rel]
        assert Image.open(io.BytesIO(shards[rel][0])).size == (112, 112)
    png = np.asarray(Image.open(io.BytesIO(shards["alice/a.png"][0])), int)
    assert np.abs(png - np.asarray(Image.open(io.BytesIO(files["alice/a.png"])), int)).mean() < 3
    by_key = {key: rel for rel, (_, _, key) in shards.items()}
    loader = make_loader(out, batch_size=5, num_workers=0, flip=False, with_keys=True)
    (images, batch_labels, keys), = list(loader)
    for image, label, key in zip(images, batch_labels, keys, strict=True):
        rel = by_key[key]
        assert int(label) == labels[rel]
        reference = np.asarray(Image.open(io.BytesIO(shards[rel][0])).convert("RGB"), int)
        assert np.abs(image.permute(1, 2, 0).numpy() - reference).max() <= 2
    identities = read_identities(out, manifest)  # the map: label -> identity folder
    assert identities.names == ("alice", "bob", "carol")
    assert identities.origin == f"the identity folder names of {src.resolve()}"
    assert main(argv) == 0  # finished folder: a rerun does nothing and succeeds
    assert "5 samples, 3 classes, 3 shards" in capsys.readouterr().out


def test_folders_without_an_identity_map_or_with_a_broken_one(image_folder, tmp_path):
    """A folder converted before maps were written reads as None (old sets stay valid); a
    map that lost names, or is missing though named, is one line naming the file."""
    out = tmp_path / "out"
    assert main(["imagefolder", str(image_folder[0]), str(out)]) == 0
    manifest = read_manifest(out)
    old = json.loads((out / MANIFEST_NAME).read_text())
    del old["identities"]
    (out / MANIFEST_NAME).write_text(json.dumps(old))
    assert read_manifest(out).identities == "" and read_identities(out, read_manifest(out)) is None
    (out / IDENTITIES_NAME).write_text(json.dumps({"origin": "x", "names": ["a", "b"]}))
    with pytest.raises(DataError, match=r"identities.json: 2 names for 3 classes"):
        read_identities(out, manifest)
    (out / IDENTITIES_NAME).unlink()
    with pytest.raises(DataError, match=r"identities.json: missing, though manifest.json"):
        read_identities(out, manifest)


def test_verify_reports_corrupt_images_and_shard_problems(image_folder, tmp_path, capsys):
    src, _ = image_folder
    (src / "bob" / "broken.jpg").write_bytes(encoded(9)[:200])  # truncated JPEG, kept verbatim
    out = tmp_path / "out"
    assert main(["imagefolder", str(src), str(out), "--samples-per-shard", "3"]) == 0
    assert main(["verify", str(out)]) == 1
    captured = capsys.readouterr()
    assert "corrupt: shard-" in captured.err and "(bob/broken.jpg)" in captured.err
    assert "1 corrupt images, 0 shard problems: FAILED" in captured.out
    loader = make_loader(out, batch_size=2, num_workers=0)
    assert sum(1 for _ in loader) == len(loader) == 3 and loader.num_skipped == 1
    (out / "shard-000001.tar").unlink()
    assert main(["verify", str(out), "--workers", "2"]) == 1
    assert "shard-000001.tar: shard listed in the manifest is missing" in capsys.readouterr().err


def test_verify_checks_the_identity_map(image_folder, tmp_path, capsys):
    src, _ = image_folder
    out = tmp_path / "out"
    assert main(["imagefolder", str(src), str(out)]) == 0
    assert main(["verify", str(out)]) == 0
    (out / IDENTITIES_NAME).write_text(json.dumps({"origin": "x", "names": ["a"]}))
    assert main(["verify", str(out)]) == 1
    assert "identities.json: 1 names for 3 classes" in capsys.readouterr().err


def test_cli_errors_and_help(tmp_path, capsys):
    assert main(["imagefolder", str(tmp_path / "none"), str(tmp_path / "out")]) == 2
    assert "none: not a folder" in capsys.readouterr().err
    (tmp_path / "empty" / "x").mkdir(parents=True)
    assert main(["imagefolder", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "identity folder holds no images" in capsys.readouterr().err
    assert main(["verify", str(tmp_path)]) == 2
    done = subprocess.run([sys.executable, "-m", "launch.convert", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert all(c in done.stdout for c in ("imagefolder", "insightface", "verify"))
