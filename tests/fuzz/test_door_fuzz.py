"""Crafted files, one for each reader the door (data_pipeline.door, docs/readers.md) closed,
each through the program a user runs: ``launch.train --check``, ``launch.convert``,
``launch.evaluate``, the loader. Each ends with one line naming the file, within the bounds of
tests/fuzz/bounds.py (5 s, 512 MiB above the start); before, each took minutes, gigabytes or
a traceback. A file over a size limit is sparse: its size is all it claims, and the door
refuses it from ``stat`` before a byte is read.
"""

from __future__ import annotations

import io
import json
import shutil
import struct
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from eval_helpers import make_run, write_ijb, write_megaface, write_rfw, write_tinyface
from launch_helpers import ROOT

from data_pipeline.codec import decode_image
from data_pipeline.errors import CorruptImageError, DataError
from data_pipeline.merge import content_of
from data_pipeline.shard_index import index_path
from launch.convert import main as convert
from launch.evaluate import main as evaluate
from launch.train import main as train
from tests.fuzz.bounds import PNG, figures, one_line, run_main
from tests.fuzz.test_shard_fuzz import SHARD, one_epoch, write_folder

GIB = 1 << 30


@pytest.fixture(scope="module")
def door_figures():
    with figures("crafted files: one per reader the door closed, through its program") as t:
        yield t


def sparse(path: Path, size: int) -> Path:
    """``path`` as a file of ``size`` bytes that takes no disk (a hole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def refused(tracked, main, argv: list[str]) -> str:
    ran, error = tracked.measure(lambda: run_main(main, argv))
    assert error is None, error
    return ran.refused()


def test_a_merge_over_a_manifest_claiming_a_trillion_classes(synthetic_data, tmp_path,
                                                              door_figures):
    """``data.merge`` sized its label map from the manifests (``np.arange(10**12)``: 7.28 TiB)
    before the head's memory check; the merged classes are now counted over the pairs alone,
    and the check speaks."""
    folder = Path(shutil.copytree(synthetic_data, tmp_path / "claims"))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.pop("identities")  # a folder converted before identity maps: 10^12 - 1 classes
    (folder / "manifest.json").write_text(json.dumps({**manifest, "num_classes": 10**12 - 1}))
    merge = tmp_path / "merge.txt"
    merge.write_text(f"set 0 {folder} {content_of(folder)}\npair 0:1 0:2\n")
    ran, error = door_figures.measure(lambda: run_main(train, [
        "--check", "--config", str(ROOT / "configs" / "smoke.yaml"), f"data.dirs=[{folder}]",
        f"data.merge={merge}", "engine.type=ddp", "device=cpu"]))
    assert error is None and ran.status == 2, (error, ran)
    heading, line = ran.lines  # a config error's heading, then its one problem
    assert heading == "config error:" and "Traceback" not in ran.err
    assert "data.num_classes=999999999998: the head's weight and optimizer state" in line


@pytest.mark.parametrize("statements", [
    ['config.a = "%0500000000d" % 0'],  # 500 MB from an 8-byte format
    [f'config.a = "{"x" * 1000}"', *["config.a = config.a + config.a"] * 7],  # 128,000
], ids=["percent", "doubled"])
def test_an_insightface_config_that_computes_a_huge_value(tmp_path, door_figures, statements):
    """``%`` and ``+`` were not bounded: six lines took 15 GB and 41 s before a MemoryError."""
    path = tmp_path / "job.py"
    path.write_text("from easydict import EasyDict as edict\nconfig = edict()\n"
                    + "\n".join(statements) + "\n")
    line = refused(door_figures, convert, ["insightface-config", str(path),
                                           str(tmp_path / "job.yaml")])
    assert line.startswith(f"import error: {path}:") and "not a literal or arithmetic" in line


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("run"))


def _evaluate(run: Path, *flags: str) -> list[str]:
    return ["--checkpoint", str(run), "--device", "cpu", *flags]


def test_an_ijb_meta_file_of_a_gigabyte(run, tmp_path, door_figures):
    root = tmp_path / "IJBC"
    write_ijb(root, [("1.jpg", 1, 1, (200, 10, 10), 0.9), ("2.jpg", 2, 2, (10, 200, 10), 0.8)],
              [(1, 2, 0)])
    huge = sparse(root / "meta" / "ijbc_template_pair_label.txt", GIB)
    line = refused(door_figures, evaluate, _evaluate(run, "--ijb", str(root)))
    assert f"{huge}: {GIB} bytes, over the limit" in line


def test_a_megaface_list_of_a_gigabyte(run, tmp_path, door_figures):
    write_megaface(tmp_path)
    huge = next(tmp_path.rglob("megaface_lst"))
    sparse(huge, GIB)
    line = refused(door_figures, evaluate, _evaluate(run, "--megaface", str(tmp_path)))
    assert f"{huge}: {GIB} bytes, over the limit" in line


@pytest.mark.parametrize("damage", ["superscript", "gigabyte"])
def test_an_rfw_pair_list(run, tmp_path, door_figures, damage):
    """A '²' passed ``isdigit()`` and ``int()`` raised a traceback; the list was read whole."""
    write_rfw(tmp_path)
    listed = next(tmp_path.rglob("*_pairs.txt"))
    if damage == "superscript":
        listed.write_text("m.x\t1\t²\n")
    else:
        sparse(listed, GIB)
    line = refused(door_figures, evaluate, _evaluate(run, "--rfw", str(tmp_path)))
    assert {"superscript": f"{listed}:1: image number '²' is not 1-12 ASCII digits",
            "gigabyte": f"{listed}: {GIB} bytes, over the limit"}[damage] in line


def _mat_header() -> bytes:
    return b"MATLAB 5.0 MAT-file".ljust(116, b" ") + bytes(8) + struct.pack("<H", 0x0100) + b"IM"


def _cell(rows: int, cols: int) -> bytes:
    """An miMATRIX cell array named ``a`` claiming ``rows`` x ``cols`` cells, holding none."""
    body = (struct.pack("<IIII", 6, 8, 1, 0) + struct.pack("<IIii", 5, 8, rows, cols)
            + struct.pack("<HHB3x", 1, 1, ord("a")))
    return struct.pack("<II", 14, len(body)) + body


def _inflating(size: int) -> bytes:
    """A compressed element that inflates to ``size`` zero bytes (1 MiB at a time)."""
    deflate, out = zlib.compressobj(9), []
    for _ in range(size >> 20):
        out.append(deflate.compress(bytes(1 << 20)))
    payload = b"".join(out) + deflate.flush()
    return struct.pack("<II", 15, len(payload)) + payload


@pytest.mark.parametrize("content", ["cells", "inflating", "gigabyte"])
def test_a_tinyface_list(run, tmp_path, door_figures, content):
    """scipy's loadmat allocated a cell array at the dimensions its header claims and
    inflated compressed variables whole."""
    write_tinyface(tmp_path)
    listed = next(tmp_path.rglob("probe_img_ID_pairs.mat"))
    if content == "gigabyte":
        sparse(listed, GIB)
    else:
        listed.write_bytes(_mat_header() + (_cell(1 << 30, 1 << 20) if content == "cells"
                                            else _inflating(256 << 20)))
    line = refused(door_figures, evaluate, _evaluate(run, "--tinyface", str(tmp_path)))
    assert line.startswith(f"error: {listed}: ") and {
        "cells": "dimensions [1073741824, 1048576]", "inflating": "inflates past",
        "gigabyte": "over the limit"}[content] in line


def test_an_insightface_property_file_of_a_gigabyte(tmp_path, door_figures):
    from tests.fuzz.test_convert_fuzz import image_record, record

    rec = record(struct.pack("<IfQQ", 0, 0.0, 0, 0)) + record(image_record(0, PNG))
    (tmp_path / "train.rec").write_bytes(rec)
    (tmp_path / "train.idx").write_text(f"0\t0\n1\t{len(record(b'x' * 24))}\n")
    huge = sparse(tmp_path / "property", GIB)
    line = refused(door_figures, convert, ["insightface", str(tmp_path),
                                           str(tmp_path / "out"), "--no-shuffle"])
    assert f"{huge}: {GIB} bytes, over the limit" in line


def test_a_shard_index_claiming_a_trillion_samples(tmp_path, door_figures):
    """``np.load`` allocated each member at the shape its header states (32 TB here) before
    the index's shape was checked."""
    folder = write_folder(tmp_path / "faces", [PNG] * 4)
    index = index_path(folder / SHARD)
    stored = dict(np.load(index))
    claimed = io.BytesIO()  # the real rows under a header claiming 10^12 of them
    np.lib.format.write_array_header_1_0(claimed, {"descr": "<i8", "fortran_order": False,
                                                   "shape": (10**12, 4)})
    with zipfile.ZipFile(index, "w") as archive:
        for name, array in stored.items():
            member = io.BytesIO()
            np.save(member, array)
            archive.writestr(f"{name}.npy", member.getvalue() if name != "members"
                             else claimed.getvalue() + array.tobytes())
    _, error = door_figures.measure(lambda: one_epoch(folder))
    line = one_line(error, (DataError,))
    assert line.startswith(f"{index}: unreadable shard index") and "1000000000000" in line


def test_an_image_pil_opens_only_in_the_formats_a_face_set_holds(door_figures):
    """Without ``formats=``, an EPS posing as a member ran Ghostscript (no timeout)."""
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 112 112\nshowpage\n"
    _, error = door_figures.measure(lambda: decode_image(eps, decoder="pil"))
    assert "cannot identify image file" in one_line(error, (CorruptImageError,))


def test_pils_bomb_warning_is_not_printed_only_the_projects_line(door_figures):
    """A PNG claiming 100 M pixels (over PIL's 89 M warning, under its 179 M error): PIL
    printed its DecompressionBombWarning beside the project's refusal, for every file."""
    ihdr = b"IHDR" + struct.pack(">II", 10000, 10000) + PNG[24:29]
    bomb = PNG[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + PNG[33:]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, error = door_figures.measure(lambda: decode_image(bomb, decoder="pil"))
    assert caught == []
    assert one_line(error, (CorruptImageError,)) == (
        "header claims 10000x10000 pixels, over the limit of 50000000 (refused before "
        "decoding)")


def test_a_pretrained_config_of_a_gigabyte(tmp_path, door_figures):
    from trainer.pretrained import load_pretrained

    huge = sparse(tmp_path / "config.json", GIB)
    (tmp_path / "model.safetensors").write_bytes(b"")
    _, error = door_figures.measure(lambda: load_pretrained(tmp_path))
    assert f"{huge}: {GIB} bytes, over the limit" in one_line(error, (ValueError,))


def test_a_run_config_of_a_gigabyte_logged_into(tmp_path, door_figures):
    """An evaluation logged into a run read its config.yaml whole before the YAML reader's
    1 MiB check."""
    from trainer.telemetry.evaluation_log import log_to_run
    from trainer.yaml_file import YamlRefused

    huge = sparse(tmp_path / "config.yaml", GIB)
    _, error = door_figures.measure(lambda: log_to_run(tmp_path, 1, {"lfw": {"acc": 1.0}}))
    assert f"{huge}: {GIB} bytes, over the limit" in one_line(error, (YamlRefused,))
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before it wrote a row


def test_an_overlap_search_over_a_manifest_claiming_a_trillion_classes(
        synthetic_data, run, tmp_path, door_figures):
    """``launch.overlap --between`` sized its ``[C, D]`` centres from the manifest."""
    from launch.overlap.__main__ import main as overlap

    claims = Path(shutil.copytree(synthetic_data, tmp_path / "claims"))
    manifest = json.loads((claims / "manifest.json").read_text())
    manifest.pop("identities")
    (claims / "manifest.json").write_text(json.dumps({**manifest, "num_classes": 10**12}))
    line = refused(door_figures, overlap, [
        "--checkpoint", str(run), "--between", f"{claims},{synthetic_data}", "--threshold",
        "0.7", "--out", str(tmp_path / "merge.txt"), "--device", "cpu"])
    assert line == (f"error: {claims}: manifest.json states 1000000000000 classes for "
                    f"{manifest['num_samples']} samples; a converted class holds one at least")
