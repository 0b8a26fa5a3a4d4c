"""TinyFace: the released folder layout (MATLAB lists) read, and rank-k through launch.evaluate."""

from __future__ import annotations

import json

import pytest
from eval_helpers import MeanColour, make_run, tinyface_cells, write_tinyface_lists
from scipy.io import savemat

from data_pipeline.errors import DataError
from data_pipeline.tinyface import read_tinyface
from launch.evaluate import main
from trainer.evaluation import evaluate_tinyface_dir


def write_tinyface(root):
    """Probe 1 white, probe 2 red. Gallery: id 1 white and grey-blue, id 2 (255, 0, 128);
    distractor red. Under MeanColour the red probe's mate scores 2/sqrt(6) < 1 (the
    distractor): rank 2; the white probe's mate is exact: rank 1."""
    return write_tinyface_lists(
        root, probes=[("p1.png", 1, (255, 255, 255)), ("p2.png", 2, (255, 0, 0))],
        matched=[("g1.png", 1, (255, 255, 255)), ("g2.png", 1, (0, 0, 255)),
                 ("g3.png", 2, (255, 0, 128))],
        distractors=[("d1.png", (255, 0, 0))])


def test_read_and_rank_by_hand(tmp_path):
    t = write_tinyface(tmp_path)
    lists = read_tinyface(tmp_path)
    assert [p.name for p in lists.gallery_paths] == ["g1.png", "g2.png", "g3.png", "d1.png"]
    assert lists.gallery_ids.tolist() == [1, 1, 2, -1] and lists.probe_ids.tolist() == [1, 2]
    out = evaluate_tinyface_dir(MeanColour(), t, batch_size=2, device="cpu")
    assert out == {"rank1": 0.5, "rank5": 1.0, "rank20": 1.0, "num_probes": 2,
                   "gallery_size": 4}


def test_layout_errors(tmp_path):
    with pytest.raises(DataError, match="no probe_img_ID_pairs.mat"):
        read_tinyface(tmp_path)
    t = write_tinyface(tmp_path)
    savemat(t / "gallery_match_img_ID_pairs.mat", {"gallery_set": tinyface_cells(["g1.png"])})
    with pytest.raises(DataError, match=r"gallery_match_img_ID_pairs.mat: no variable "
                                        r"'gallery_ids'"):
        read_tinyface(t)


def test_cli_table_and_json(tmp_path, capsys):
    write_tinyface(tmp_path)
    assert main(["--checkpoint", str(make_run(tmp_path)), "--tinyface", str(tmp_path),
                 "--device", "cpu", "--json", str(tmp_path / "r.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["set", "probes", "gallery", "rank-1"]
    assert lines[2].split()[:3] == ["TinyFace", "2", "4"]
    assert set(json.loads((tmp_path / "r.json").read_text())["TinyFace"]) == {
        "rank1", "rank5", "rank20", "num_probes", "gallery_size"}
