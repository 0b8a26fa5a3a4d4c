"""Fuzzing the evaluation inputs: ``launch.evaluate --bin`` (its ``main`` in this process on a
tiny checkpoint), the IJB folder reader (meta files and loose crops, read and aligned as
``--ijb`` reads them), TinyFace's, MegaFace's and RFW's lists, and the exclusion lists
``launch.overlap --held-out`` and ``data.exclude`` read. Whatever the files hold: exit status
0 with a table, or 2 and one line (``--bin``, ``--held-out``); what the reader reads or a
one-line DataError (the others); within the bounds of tests/fuzz/bounds.py.

Seeds: a valid 10-pair ``.bin`` (pickle) with the issue's JPEG inside or damaged (huge
declared byte strings, flipped opcodes, truncations, deep nesting); a two-face IJB folder with
each meta file or image damaged; the fabricated TinyFace, MegaFace and RFW folders of
tests/eval_helpers.py with a list damaged or replaced; an exclusion list damaged.
"""

from __future__ import annotations

import argparse
import pickle
import shutil
import tempfile
from pathlib import Path

import pytest
from eval_helpers import make_run, write_ijb, write_megaface, write_rfw, write_tinyface
from hypothesis import example, given
from hypothesis import strategies as st

from data_pipeline.errors import DataError
from data_pipeline.exclusion import Exclusions, write_exclusions
from data_pipeline.ijb import iter_aligned_faces, read_ijb_meta
from data_pipeline.megaface import read_megaface
from data_pipeline.rfw import read_rfw_pairs
from data_pipeline.tinyface import read_tinyface
from launch.evaluate import main
from launch.overlap.held_out import held_out_classes
from tests.fuzz.bounds import BOMB, JPEG, PNG, damaged, figures, fuzz_settings, one_line, run_main

BIN = pickle.dumps(([JPEG, PNG] * 10, [True, False] * 5), protocol=4)
NESTED = b"\x80\x04" + b"]" * 100_000 + b"."  # a list 10^5 deep


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def eval_figures():
    with figures("evaluation sets: --bin (main), IJB, TinyFace, MegaFace, RFW, exclusion lists"
                 ) as tracked:
        yield tracked


@fuzz_settings(examples=8)
@given(data=damaged(BIN) | st.just(NESTED))
@example(data=pickle.dumps(([JPEG, BOMB] * 10, [True, False] * 5), protocol=4))
def test_bins(run, eval_figures, data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "set.bin"
        path.write_bytes(data)
        ran, error = eval_figures.measure(lambda: run_main(main, [
            "--checkpoint", str(run), "--bin", str(path), "--device", "cpu"]))
    assert error is None, error
    if ran.status != 0:
        ran.refused()
    eval_figures.count(f"--bin: exit {ran.status}")


@pytest.fixture(scope="module")
def ijb(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ijb") / "IJBC"
    write_ijb(root, [("1.jpg", 1, 1, (200, 10, 10), 0.9), ("2.jpg", 2, 2, (10, 200, 10), 0.8)],
              [(1, 2, 0)])
    return root


IJB_FILES = ["meta/ijbc_face_tid_mid.txt", "meta/ijbc_name_5pts_score.txt",
             "meta/ijbc_template_pair_label.txt", "loose_crop/1.jpg"]


@fuzz_settings(examples=12)
@given(data=st.data())
def test_ijb_folders(ijb, eval_figures, data):
    name = data.draw(st.sampled_from(IJB_FILES))
    original = (ijb / name).read_bytes()
    blob = data.draw(damaged(original) | (st.just(BOMB) if name.endswith(".jpg") else
                                          st.binary(max_size=64)))
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(shutil.copytree(ijb, Path(tmp) / "IJBC"))
        (copy / name).write_bytes(blob)
        faces, error = eval_figures.measure(lambda: [
            len(b) for b in iter_aligned_faces(read_ijb_meta(copy.parent))])
    if error is not None:
        one_line(error, (DataError,))
    eval_figures.count(f"ijb: {'refused' if error is not None else 'read'}")


LIST = b"# launch.overlap\nclass 3  # m.0abc: lfw 0.7\nclass 11\nsample 000000012\n"


@fuzz_settings(examples=10)
@given(data=damaged(LIST) | st.binary(max_size=200))
def test_exclusion_lists(eval_figures, data):
    parser = argparse.ArgumentParser(prog="launch.overlap")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "held_out.txt"
        path.write_bytes(data)
        ran, error = eval_figures.measure(lambda: run_main(
            lambda _: held_out_classes(parser, path) and 0, []))
    assert error is None, error
    if ran.status != 0:
        assert ran.lines[-1].startswith("launch.overlap: error: --held-out"), ran.err
    eval_figures.count(f"--held-out: exit {ran.status}")


def test_an_exclusion_list_round_trips(tmp_path):
    """The seed is what write_exclusions writes (the fuzz starts from a valid list)."""
    write_exclusions(tmp_path / "l.txt", Exclusions(frozenset({"000000012"}), frozenset({3, 11})))
    assert held_out_classes(argparse.ArgumentParser(), tmp_path / "l.txt") == {3, 11}


@pytest.fixture(scope="module")
def eval_sets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sets")
    write_tinyface(root / "tinyface")
    write_megaface(root / "megaface")
    write_rfw(root / "rfw")
    return root


LISTS = {"tinyface/tinyface/Testing_Set/probe_img_ID_pairs.mat":
         lambda root: read_tinyface(root / "tinyface"),
         "tinyface/tinyface/Testing_Set/gallery_match_img_ID_pairs.mat":
         lambda root: read_tinyface(root / "tinyface"),
         "megaface/data/facescrub_lst": lambda root: read_megaface(root / "megaface"),
         "megaface/data/megaface_lst": lambda root: read_megaface(root / "megaface"),
         "rfw/test/txts/African/African_pairs.txt":
         lambda root: read_rfw_pairs(root / "rfw" / "test", "African")}


@fuzz_settings(examples=10)
@given(data=st.data())
def test_tinyface_megaface_and_rfw_lists(eval_sets, eval_figures, data):
    """The other evaluation sets' lists (TinyFace's MATLAB files, MegaFace's and RFW's text):
    the lists or a one-line DataError."""
    name = data.draw(st.sampled_from(sorted(LISTS)))
    blob = data.draw(damaged((eval_sets / name).read_bytes()) | st.binary(max_size=64))
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(shutil.copytree(eval_sets, Path(tmp) / "sets"))
        (copy / name).write_bytes(blob)
        _, error = eval_figures.measure(lambda: LISTS[name](copy))
    if error is not None:
        one_line(error, (DataError,))
    eval_figures.count(f"{name.rsplit('/', 1)[-1]}: {'refused' if error else 'read'}")
