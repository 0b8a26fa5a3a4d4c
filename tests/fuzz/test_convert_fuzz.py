"""Fuzzing ``launch.convert`` from an image folder and from insightface's ``.rec``: whatever
an image, ``train.rec``, ``train.idx`` or ``property`` holds, the conversion ends with exit
status 0 and one warning line naming each image it could not re-encode (stored as is, for the
loader to skip and count), or with exit status 2 and one line; within the bounds of
tests/fuzz/bounds.py. The program's ``main`` runs in this process; the issue's JPEG goes
through the real program too.

Seeds: the issue's JPEG, damaged JPEGs and PNGs in an identity folder; a valid 4-record
``.rec`` (insightface's layout: header record 0, three images) damaged (huge record lengths,
flipped bits, truncations), its ``.idx`` damaged, and ``property`` files of any text.
"""

from __future__ import annotations

import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from data_pipeline.codec import prepare_jpeg
from data_pipeline.recordio import MAGIC
from launch.convert import main
from tests.fuzz.bounds import (
    BOMB,
    JPEG,
    MEMORY,
    PNG,
    SECONDS,
    claiming,
    damaged,
    figures,
    fuzz_settings,
    run_main,
    run_program,
)


def record(payload: bytes) -> bytes:
    """One whole RecordIO record (magic, length, payload, padding to 4 bytes)."""
    return struct.pack("<II", MAGIC, len(payload)) + payload + bytes(-len(payload) % 4)


def image_record(label: float, image: bytes) -> bytes:
    return struct.pack("<IfQQ", 0, label, 0, 0) + image


@pytest.fixture(scope="module")
def rec_folder(tmp_path_factory) -> Path:
    """insightface's layout: record 0 says images are keys 1..3 and identities 4..5."""
    root = tmp_path_factory.mktemp("rec")
    payloads = {0: struct.pack("<IfQQ", 2, 0.0, 0, 0) + struct.pack("<2f", 4, 6)}
    payloads.update({k: image_record(k % 2, JPEG) for k in (1, 2, 3)})
    rec, idx = b"", ""
    for key, payload in payloads.items():
        idx += f"{key}\t{len(rec)}\n"
        rec += record(payload)
    (root / "train.rec").write_bytes(rec)
    (root / "train.idx").write_text(idx)
    (root / "property").write_text("2,112,112\n")
    return root


@pytest.fixture(scope="module")
def convert_figures():
    with figures("convert: launch.convert imagefolder and insightface (main)") as tracked:
        yield tracked


def _convert(tracked, command: str, src: Path) -> None:
    """``launch.convert COMMAND src out``: 0 with a warning per image it stored as is, or 2
    and one line."""
    with tempfile.TemporaryDirectory() as tmp:
        ran, error = tracked.measure(lambda: run_main(main, [command, str(src),
                                                             f"{tmp}/out", "--no-shuffle"]))
    assert error is None, error
    if ran.status == 0:
        assert all(line.startswith("warning: ") and "stored as is" in line
                   for line in ran.lines), ran.err
        tracked.count(f"{command}: converted, {len(ran.lines)} named")
    else:
        ran.refused()
        tracked.count(f"{command}: refused")


@fuzz_settings(examples=10)
@given(image=damaged(JPEG) | damaged(PNG) | st.just(BOMB), suffix=st.sampled_from(
    [".jpg", ".png"]))
def test_image_folders(convert_figures, image, suffix):
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp)
        (src / "alice").mkdir()
        (src / "bob").mkdir()
        (src / "alice" / f"x{suffix}").write_bytes(image)
        (src / "bob" / "y.jpg").write_bytes(JPEG)
        _convert(convert_figures, "imagefolder", src)


@fuzz_settings(examples=15)
@given(data=st.data())
def test_rec_folders(rec_folder, convert_figures, data):
    name = data.draw(st.sampled_from(["train.rec", "train.rec", "train.idx", "property"]))
    blob = data.draw(damaged((rec_folder / name).read_bytes())
                     | (st.binary(max_size=40) if name == "property" else st.nothing()))
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(shutil.copytree(rec_folder, Path(tmp) / "src"))
        (src / name).write_bytes(blob)
        _convert(convert_figures, "insightface", src)


def test_the_issue_jpeg_through_the_program(tmp_path):
    """``python -m launch.convert imagefolder``: the issue's JPEG and one claiming 12000x12000
    (under PIL's own bomb limit: 1.3 GB and 4.1 s to re-encode before the pixel limit) are
    each named in one line and stored as is; the run stays near a clean folder's peak."""
    for folder, images in (("clean", [JPEG, JPEG]),
                           ("bombs", [BOMB, claiming(JPEG, 12000, 12000)])):
        for i, image in enumerate(images):
            (tmp_path / folder / f"id{i}").mkdir(parents=True)
            (tmp_path / folder / f"id{i}" / "a.jpg").write_bytes(image)
    clean = run_program("launch.convert", "imagefolder", str(tmp_path / "clean"),
                        str(tmp_path / "clean-out"))
    bombs = run_program("launch.convert", "imagefolder", str(tmp_path / "bombs"),
                        str(tmp_path / "bombs-out"))
    assert clean.status == 0 and bombs.status == 0, bombs.err
    named = [line for line in bombs.err.splitlines() if line.startswith("warning: ")]
    assert len(named) == 2 and "id0/a.jpg (header claims 60000x60000" in named[0], bombs.err
    assert "Traceback" not in bombs.err
    assert bombs.peak_bytes - clean.peak_bytes < min(MEMORY, 64 << 20)
    assert bombs.cpu_s < clean.cpu_s + SECONDS


def test_max_pixels_is_the_converters_setting(tmp_path):
    """``--max-pixels``: a limit under 112 x 112 names every image; the loader's default keeps
    them (the flag is the converter's, not a global)."""
    for name in ("a", "b"):
        (tmp_path / "src" / name).mkdir(parents=True)
        (tmp_path / "src" / name / "x.png").write_bytes(PNG)
    ran = run_main(main, ["imagefolder", str(tmp_path / "src"), str(tmp_path / "out"),
                          "--max-pixels", "10000"])
    assert ran.status == 0 and len(ran.lines) == 2, ran.err
    assert all("header claims 112x112 pixels, over the limit of 10000" in line
               for line in ran.lines)
    assert prepare_jpeg(PNG, 112)[:3] == b"\xff\xd8\xff"  # re-encoded under the default
