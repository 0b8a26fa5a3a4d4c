"""The train/test overlap's command line (``python -m launch.overlap``) on every evaluation
format, end to end: ``launch.convert``'s folder of 20 named identities, and one small
fabricated folder per format (a .bin, RFW's group .bins and its released folder, TinyFace,
IJB-C), each sharing one training identity, found and named with its nearest training image;
a folder converted before identity maps, listed by label; ``--data`` at a URL, giving the
local answer. The embedding is ``test_overlap.py``'s colour features, built, not trained.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from eval_helpers import make_run, write_ijb, write_tinyface_lists
from test_overlap import THRESHOLD, ColourFeatures, evaluation_images, ijb_crop

from data_pipeline.codec import decode_image
from data_pipeline.exclusion import read_exclusions
from data_pipeline.synthetic import SyntheticSource
from data_pipeline.verification_bin import write_bin

NAMED = {3: "lfw", 7: "RFW/African", 11: "TinyFace", 15: "IJBC"}  # planted: label -> set


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``python -m launch.convert imagefolder``'s output for 20 named identity folders
    (``person_00`` ... ``person_19``, images 0..7 of the synthetic identities), and its
    source folder."""
    from launch.convert import main as convert

    root = tmp_path_factory.mktemp("named")
    source = SyntheticSource(20, 16, seed=0)
    for label in range(20):
        folder = root / "src" / f"person_{label:02d}"
        folder.mkdir(parents=True)
        for i in range(8):
            (folder / f"{i}.jpg").write_bytes(source.read(label * 16 + i)[0])
    assert convert(["imagefolder", str(root / "src"), str(root / "data"),
                    "--samples-per-shard", "50"]) == 0
    return root


def _unseen(label: int, count: int) -> list[bytes]:
    """Images 8.. of a training identity: not in the shards."""
    source = SyntheticSource(20, 16, seed=0)
    return [source.read(label * 16 + 8 + i)[0] for i in range(count)]


def _strangers(first: int, count: int) -> list[bytes]:
    return evaluation_images()[20 + first:20 + first + count]


@pytest.fixture(scope="module")
def sets(converted):
    """One small folder per evaluation format, each sharing one training identity (NAMED):
    lfw.bin, RFW's four group .bins (African), TinyFace's Testing_Set and an IJB-C folder."""
    root = converted / "sets"
    (root / "rfw").mkdir(parents=True)
    write_bin(root / "lfw.bin", _unseen(3, 4) + _strangers(0, 8), [True, True] + [False] * 4)
    for k, group in enumerate(("African", "Asian", "Caucasian", "Indian")):
        planted = _unseen(7, 2) if group == "African" else _strangers(40 + 4 * k, 2)
        write_bin(root / "rfw" / f"{group}_test.bin", planted + _strangers(60 + 4 * k, 4),
                  [True, False, False])
    rgb = [decode_image(b) for b in _unseen(11, 2) + _strangers(80, 3)]
    write_tinyface_lists(root, probes=[("1_1.jpg", 1, rgb[0])],
                         matched=[("1_2.jpg", 1, rgb[1]), ("2_1.jpg", 2, rgb[2])],
                         distractors=[("d1.jpg", rgb[3]), ("d2.jpg", rgb[4])])
    faces = [(f"{i}.png", i, i, ijb_crop(b), 1.0)
             for i, b in enumerate(_unseen(15, 2) + _strangers(100, 4))]
    write_ijb(root / "IJBC", faces, [(0, 1, 1)])
    return root


def _run_overlap(monkeypatch, tmp_path, data, *sets_args: str) -> tuple[int, dict, str]:
    """``launch.overlap`` with the colour embedding standing in for the checkpoint's
    backbone (it reveals the synthetic identities, see the module docstring)."""
    import launch.overlap.__main__ as overlap
    from launch.overlap import against_eval_sets

    monkeypatch.setattr(against_eval_sets, "load_backbone_or_exit", lambda path: ColourFeatures())
    out, js = tmp_path / "overlap.txt", tmp_path / "overlap.json"
    rc = overlap.main(["--checkpoint", str(make_run(tmp_path)), "--data", str(data),
                       *sets_args, "--threshold", str(THRESHOLD), "--out", str(out),
                       "--json", str(js), "--device", "cpu"])
    return rc, (json.loads(js.read_text()) if rc == 0 else {}), out


def test_every_evaluation_format_names_its_shared_identity_and_source(
        converted, sets, tmp_path, monkeypatch, capsys):
    """lfw.bin, RFW, TinyFace and IJB-C each share their planted identity, listed by its
    folder name with the matched image and the identity's nearest training image (its
    source path and shard key, checked against a brute-force search over the shards)."""
    from data_pipeline import read_manifest
    from data_pipeline.tar_reader import tar_samples
    from trainer.evaluation import embed_images, eval_mode

    rc, found, out = _run_overlap(
        monkeypatch, tmp_path, converted / "data", "--bins", str(sets / "lfw.bin"),
        "--rfw", str(sets / "rfw"), "--tinyface", str(sets), "--ijb", str(sets / "IJBC"))
    assert rc == 0
    printed = capsys.readouterr().out
    assert found["identity_names"] == (
        f"the identity folder names of {(converted / 'src').resolve()}")
    assert found["source_root"] == str((converted / "src").resolve())
    assert [s["name"] for s in found["sets"]] == ["lfw", "RFW/African", "RFW/Asian",
                                                  "RFW/Caucasian", "RFW/Indian", "IJBC",
                                                  "TinyFace"]
    rows = {row["set"]: row for row in found["shared"]}
    assert {s: r["label"] for s, r in rows.items()} == {s: c for c, s in NAMED.items()}
    assert {r["image"] for r in rows.values()} <= {"lfw.bin[0]", "lfw.bin[1]", "lfw.bin[2]",
                                                    "lfw.bin[3]", "African_test.bin[0]",
                                                    "African_test.bin[1]", "Probe/1_1.jpg",
                                                    "Gallery_Match/1_2.jpg",
                                                    "loose_crop/0.png", "loose_crop/1.png"}
    stored = {}
    data = converted / "data"
    for shard in read_manifest(data).shards:
        for sample in tar_samples(data / shard.name):
            stored[sample["__key__"]] = (sample["src"].decode(), sample["jpg"])
    model = ColourFeatures()
    for row in rows.values():
        name = f"person_{row['label']:02d}"
        assert row["identity"] == name and row["source"].startswith(name + "/")
        assert stored[row["key"]][0] == row["source"] and row["score"] >= THRESHOLD
        assert f"{row['set']} {row['image']} ~ class {row['label']} {name} (cos " in printed
    lfw = rows["lfw"]  # the nearest training image, by brute force
    own = {src: jpg for src, jpg in stored.values() if src.startswith("person_03/")}
    blobs = [own[s] for s in sorted(own)] + [_unseen(3, 4)[int(lfw["image"][8:-1])]]
    with eval_mode(model):
        emb = embed_images(model, np.stack([decode_image(b).transpose(2, 0, 1)
                                            for b in blobs]), 16, "cpu")
    cos = (emb[:-1] @ emb[-1]).tolist()
    assert sorted(own)[int(np.argmax(cos))] == lfw["source"]
    assert lfw["sample_score"] == pytest.approx(max(cos), abs=1e-5)
    listed = read_exclusions(out)
    assert listed.classes == frozenset(NAMED)
    assert "\nclass 3  # person_03: lfw lfw.bin[" in out.read_text()


def test_a_folder_converted_before_identity_maps_is_listed_by_label(
        converted, sets, tmp_path, monkeypatch, capsys):
    import shutil

    from data_pipeline.manifest import MANIFEST_NAME

    old = tmp_path / "old"
    shutil.copytree(converted / "data", old)
    manifest = json.loads((old / MANIFEST_NAME).read_text())
    del manifest["identities"]
    (old / MANIFEST_NAME).write_text(json.dumps(manifest))
    rc, found, out = _run_overlap(monkeypatch, tmp_path, old, "--bins", str(sets / "lfw.bin"))
    assert rc == 0
    assert f"identity names: none ({old} was converted before" in capsys.readouterr().out
    (row,) = found["shared"]
    assert found["identity_names"] is None and row["identity"] is None
    assert row["label"] == 3 and row["source"].startswith("person_03/")
    assert "\nclass 3  # lfw lfw.bin[" in out.read_text()


def test_a_data_folder_at_a_url_gives_the_local_answer(converted, sets, tmp_path,
                                                        monkeypatch, capsys):
    """``--data`` over HTTP (the loopback file server of the remote-data tests) and as a
    file:// URL: the same rows as the local folder; a missing folder is one line, rc 2."""
    from tools.remote_servers import FileServer

    bins = ("--bins", str(sets / "lfw.bin"))
    _, local, _ = _run_overlap(monkeypatch, tmp_path / "local", converted / "data", *bins)
    server = FileServer(converted)
    try:
        _, http, _ = _run_overlap(monkeypatch, tmp_path / "http", f"{server.url}/data", *bins)
        # each shard (under a read's piece) in one request per pass (the centres, then the
        # nearest images)
        assert len(server.gets("shard-000000.tar")) == 2
        capsys.readouterr()
        rc, _, _ = _run_overlap(monkeypatch, tmp_path / "gone", f"{server.url}/gone", *bins)
    finally:
        server.close()
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {server.url}/gone/manifest.json: not found (404")
    assert "\n" not in err
    _, file_url, _ = _run_overlap(monkeypatch, tmp_path / "file",
                                  (converted / "data").as_uri(), *bins)
    assert http["shared"] == local["shared"] == file_url["shared"] and local["shared"]


def _write_rfw_folder(root, groups: dict[str, list[bytes]]) -> None:
    """RFW's released layout (data_pipeline.rfw): per group one genuine pair of its first two
    images (identity ``m.<group>``), then impostor pairs of the rest, one identity each."""
    for group, images in groups.items():
        lines, owner = [f"m.{group}\t1\t2"], [f"m.{group}"] * 2
        owner += [f"m.{group}{i}" for i in range(2, len(images))]
        lines += [f"{owner[i]}\t1\t{owner[i + 1]}\t1" for i in range(2, len(images), 2)]
        for i, blob in enumerate(images):
            number = 1 + i if i < 2 else 1
            path = root / "data" / group / owner[i] / f"{owner[i]}_{number:04d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(blob)
        (root / "txts" / group).mkdir(parents=True)
        (root / "txts" / group / f"{group}_pairs.txt").write_text("\n".join(lines) + "\n")


def test_rfw_from_its_released_folder_as_from_its_bins(converted, tmp_path, monkeypatch,
                                                       capsys):
    """``--rfw`` on the released folder of images and pair lists (what ``launch.evaluate
    --rfw`` also reads) finds the identity planted in RFW/African, named by the image's path;
    a missing list or form is one line."""
    import launch.overlap.__main__ as overlap

    groups = {group: (_unseen(7, 2) if group == "African" else _strangers(40 + 4 * k, 2))
              + _strangers(60 + 4 * k, 4)
              for k, group in enumerate(("African", "Asian", "Caucasian", "Indian"))}
    _write_rfw_folder(tmp_path / "RFW" / "test", groups)
    rc, found, _ = _run_overlap(monkeypatch, tmp_path, converted / "data",
                                "--rfw", str(tmp_path / "RFW"))
    assert rc == 0
    assert [s["name"] for s in found["sets"]] == [f"RFW/{g}" for g in groups]
    assert [s["images"] for s in found["sets"]] == [6] * 4
    ((label, image),) = {(r["label"], r["image"]) for r in found["shared"]}
    assert label == 7 and image in {"data/African/m.African/m.African_0001.jpg",
                                    "data/African/m.African/m.African_0002.jpg"}

    capsys.readouterr()
    listed = tmp_path / "RFW" / "test" / "txts" / "Indian" / "Indian_pairs.txt"
    listed.unlink()
    assert overlap.main(["--checkpoint", str(make_run(tmp_path / "missing")), "--data",
                         str(converted / "data"), "--rfw", str(tmp_path / "RFW"), "--out",
                         str(tmp_path / "o.txt"), "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {listed}: cannot read RFW pair list (No such file or directory)")
    with pytest.raises(SystemExit):
        overlap.main(["--checkpoint", "x", "--data", str(converted / "data"), "--rfw",
                      str(tmp_path), "--out", str(tmp_path / "o.txt")])
    assert (f"--rfw {tmp_path}: no African_test.bin, African.bin or "
            "txts/African/African_pairs.txt") in capsys.readouterr().err
