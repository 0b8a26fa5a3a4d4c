"""TinyFace: the released folder layout (MATLAB lists) read, and rank-k through launch.evaluate."""

from __future__ import annotations

import json

import pytest
from eval_helpers import MeanColour, make_run, solid_image, tinyface_cells, write_tinyface
from scipy.io import savemat

from data_pipeline.errors import DataError
from data_pipeline.tinyface import read_tinyface
from launch.evaluate import main
from trainer.evaluation import evaluate_tinyface_dir


def test_read_and_rank_by_hand(tmp_path):
    t = write_tinyface(tmp_path)
    lists = read_tinyface(tmp_path)
    assert [p.name for p in lists.gallery_paths] == ["g1.png", "g2.png", "g3.png", "d1.png"]
    assert lists.gallery_ids.tolist() == [1, 1, 2, -1] and lists.probe_ids.tolist() == [1, 2]
    out = evaluate_tinyface_dir(MeanColour(), t, batch_size=2, device="cpu")
    assert out == {"rank1": 0.5, "rank5": 1.0, "rank20": 1.0, "num_probes": 2,
                   "gallery_size": 4, "alignment": "none"}


def test_aligned_images_replace_the_released_crops(tmp_path):
    # AdaFace's layout: <root>/aligned_pad_0.1_pad_high/<subset>/<same stem>.jpg beside
    # <root>/tinyface/Testing_Set. The aligned red probe is (255, 0, 128), exactly its mate
    # g3: rank 1 for both probes.
    write_tinyface(tmp_path)
    aligned = tmp_path / "aligned_pad_0.1_pad_high"
    for subset, name, rgb in (("Probe", "p1", (255, 255, 255)), ("Probe", "p2", (255, 0, 128)),
                              ("Gallery_Match", "g1", (255, 255, 255)),
                              ("Gallery_Match", "g2", (0, 0, 255)),
                              ("Gallery_Match", "g3", (255, 0, 128)),
                              ("Gallery_Distractor", "d1", (255, 0, 0))):
        solid_image(aligned / subset / f"{name}.png", rgb)  # aligned: 112x112
    lists = read_tinyface(tmp_path)
    assert lists.aligned and lists.probe_paths[1] == aligned / "Probe" / "p2.png"
    out = evaluate_tinyface_dir(MeanColour(), tmp_path, batch_size=2, device="cpu")
    assert out["rank1"] == 1.0 and out["alignment"] == "aligned_pad_0.1_pad_high"
    (aligned / "Gallery_Match" / "g2.png").unlink()
    with pytest.raises(DataError, match=r"Gallery_Match: no aligned image for g2.png \(1 of 3"):
        read_tinyface(tmp_path)


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
    assert lines[2].split()[:3] == ["TinyFace/unaligned", "2", "4"]
    assert set(json.loads((tmp_path / "r.json").read_text())["TinyFace/unaligned"]) == {
        "rank1", "rank5", "rank20", "num_probes", "gallery_size", "alignment"}
