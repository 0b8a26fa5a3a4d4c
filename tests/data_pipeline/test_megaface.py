"""MegaFace: insightface's testsuite layout read, and rank-1 at two distractor counts by hand."""

from __future__ import annotations

import json

import pytest
from eval_helpers import MeanColour, make_run, write_megaface

from data_pipeline.errors import DataError
from data_pipeline.megaface import read_megaface
from launch.evaluate import main
from trainer.evaluation import evaluate_megaface_dir


def test_read_and_rank_by_hand(tmp_path):
    data = write_megaface(tmp_path)
    lists = read_megaface(tmp_path)
    assert lists.probe_identities.tolist() == [0, 0, 0, 1, 1]
    assert lists.probe_noisy.tolist() == [False, False, True, False, False]
    assert lists.distractor_noisy.tolist() == [False, True, False, False]
    out = evaluate_megaface_dir(MeanColour(), data, batch_size=2, device="cpu", sizes=(2, 4, 10))
    assert out == {"MegaFace@2": {"rank1": 1.0, "num_probes": 8, "gallery_size": 3},
                   "MegaFace@4": {"rank1": 0.75, "num_probes": 8, "gallery_size": 5}}


def test_without_noise_lists_the_noise_counts(tmp_path):
    # d2 is searched now: it beats a1's mates (a1.d2 = 0.9997 > 0.818) but not a1 as a2's
    # mate (a2.d2 = 0.813 < a1.a2 = 0.818); the black a3 matches nothing (its mates score
    # <= -0.8, d1 1/3); b2.d2 = 0.351 > b1.b2 = 1/3, b1.d2 = -0.324 < 1/3. Two pairs count:
    # (mate a1, probe a2) and (mate b2, probe b1).
    write_megaface(tmp_path, noises=False)
    out = evaluate_megaface_dir(MeanColour(), tmp_path, batch_size=4, device="cpu", sizes=(2,))
    assert out["MegaFace@2"]["rank1"] == pytest.approx(2 / 8)


def test_layout_errors(tmp_path):
    with pytest.raises(DataError, match="no facescrub_lst here or in data/"):
        read_megaface(tmp_path)
    data = write_megaface(tmp_path)
    (data / "megaface_lst").unlink()
    with pytest.raises(DataError, match=r"megaface_lst: cannot read MegaFace list"):
        read_megaface(data)
    (data / "megaface_lst").write_text("0/0/d1.png\nd9.png\n")
    with pytest.raises(DataError, match=r"megaface_lst: line 2 'd9.png' is not a path of 3"):
        read_megaface(data)
    (data / "megaface_lst").write_text("0/0/d1.png\n0/0/gone.png\n")
    with pytest.raises(DataError, match=r"gone.png: cannot read MegaFace image"):
        evaluate_megaface_dir(MeanColour(), data, batch_size=2, device="cpu", sizes=(2,))
    with pytest.raises(DataError, match="holds 2 distractors, fewer than the smallest size"):
        evaluate_megaface_dir(MeanColour(), data, batch_size=2, device="cpu", sizes=(10,))


def test_cli_table_and_json(tmp_path, capsys):
    data = write_megaface(tmp_path)
    assert main(["--checkpoint", str(make_run(tmp_path)), "--megaface", str(data),
                 "--megaface-sizes", "2", "4", "--device", "cpu",
                 "--json", str(tmp_path / "r.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["set", "probes", "gallery", "rank-1"]
    assert [line.split()[:3] for line in lines[2:4]] == [["MegaFace@2", "8", "3"],
                                                         ["MegaFace@4", "8", "5"]]
    assert set(json.loads((tmp_path / "r.json").read_text())) == {"MegaFace@2", "MegaFace@4"}
