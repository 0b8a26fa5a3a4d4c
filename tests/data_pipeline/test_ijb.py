"""IJB-B/C 1:1: template pooling, TAR@FAR, 5-point alignment and a fabricated IJB_release folder."""

from __future__ import annotations

import json

import numpy as np
import pytest
from eval_helpers import MeanColour, make_run, write_ijb
from skimage.transform import SimilarityTransform, warp

from data_pipeline.errors import DataError
from data_pipeline.ijb import ARCFACE_REFERENCE, align_face, read_ijb_1n_meta, read_ijb_meta
from launch.evaluate import main
from partial_fc.eval.ijb import pair_scores, tar_at_far_closest, template_features
from trainer.evaluation import evaluate_ijb_dir


def test_template_features_by_hand():
    # Template 1: media 10 = {(1,0), (0,1)} -> mean (.5,.5); media 11 = {(1,0)} with
    # detector score .5 -> (.5,0); sum (1, .5) -> (2,1)/sqrt5. Template 2: (3,0) -> (1,0).
    # Template 3: (0,2) -> (0,1).
    feats = np.array([[1, 0], [0, 1], [1, 0], [3, 0], [0, 2]], dtype=float)
    templates = np.array([1, 1, 1, 2, 3])
    medias = np.array([10, 10, 11, 12, 13])
    scores = np.array([1.0, 1.0, 0.5, 0.9, 1.0])
    ids, tf = template_features(feats, templates, medias, scores)
    np.testing.assert_array_equal(ids, [1, 2, 3])
    np.testing.assert_allclose(tf, [[2 / 5**0.5, 1 / 5**0.5], [1, 0], [0, 1]], atol=1e-12)
    s = pair_scores(ids, tf, [1, 1, 2], [2, 3, 3])
    np.testing.assert_allclose(s, [2 / 5**0.5, 1 / 5**0.5, 0], atol=1e-12)
    # Unweighted, template 1 is (.5,.5) + (1,0) = (1.5,.5): cosine with (1,0) is 1.5/sqrt(2.5).
    ids, tf = template_features(feats, templates, medias, None)
    assert pair_scores(ids, tf, [1], [2])[0] == pytest.approx(1.5 / 2.5**0.5)
    with pytest.raises(ValueError, match="template 7 that has no images"):
        pair_scores(ids, tf, [1], [7])


def test_image_norm_kept_weights_by_norm():
    # One template, one media: (3,0) and (0,1). Norm kept (eval_ijbc.py): mean (1.5,.5)
    # -> (3,1)/sqrt10, cosine with (1,0) 3/sqrt10. Unit: (.5,.5) -> 1/sqrt2.
    feats = np.array([[3.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    templates, medias = np.array([1, 1, 2]), np.array([5, 5, 6])
    for norm, expected in (("kept", 3 / 10**0.5), ("unit", 1 / 2**0.5)):
        ids, tf = template_features(feats, templates, medias, None, image_norm=norm)
        assert pair_scores(ids, tf, [1], [2])[0] == pytest.approx(expected)
    with pytest.raises(ValueError, match="image_norm 'l2': choose one of kept, unit"):
        template_features(feats, templates, medias, None, image_norm="l2")


def test_tar_at_far_closest_by_hand():
    # Scores P .9, P .8, N .7, P .3, N .2, N .1, N 0. roc_curve keeps (0,0), (0,2/3),
    # (.25,2/3), (.25,1), (1,1). FAR 1e-3 -> FPR 0 -> TAR 2/3 (highest at that FPR);
    # 0.2 -> FPR .25 -> TAR 1; 0.9 -> FPR 1 -> TAR 1.
    labels = [1, 1, 0, 1, 0, 0, 0]
    scores = [0.9, 0.8, 0.7, 0.3, 0.2, 0.1, 0.0]
    got = tar_at_far_closest(labels, scores, fars=(1e-3, 0.2, 0.9))
    assert got == pytest.approx({1e-3: 2 / 3, 0.2: 1.0, 0.9: 1.0})


def _smooth_face() -> np.ndarray:
    y, x = np.mgrid[0:112, 0:112].astype(float)
    img = np.stack([128 + 60 * np.sin(x / 7), 128 + 60 * np.cos(y / 9),
                    128 + 40 * np.sin((x + y) / 11)], axis=-1)
    return img.astype(np.uint8)


def test_align_identity_and_known_similarity():
    face = _smooth_face()
    assert np.abs(align_face(face, ARCFACE_REFERENCE).astype(int) - face).max() <= 1
    # Place the face into a 320x320 loose crop by a known similarity (scale 1.7, 20 degrees).
    known = SimilarityTransform(scale=1.7, rotation=np.deg2rad(20), translation=(90, 40))
    crop = warp(face, known.inverse, output_shape=(320, 320), order=1, preserve_range=True)
    crop = crop.astype(np.uint8)
    landmarks = known(ARCFACE_REFERENCE)
    aligned = align_face(crop, landmarks).astype(float)
    inner = (slice(8, -8), slice(8, -8))
    assert np.abs(aligned[inner] - face[inner]).mean() < 2.0
    shifted = align_face(crop, landmarks + [12.0, 0.0]).astype(float)
    assert np.abs(shifted[inner] - face[inner]).mean() > 10.0  # the check can fail


# White a -> unit (1,1,1)/sqrt3, red b -> (1,-1,-1)/sqrt3 under MeanColour.
_A, _B = (255, 255, 255), (255, 0, 0)
_FACES = [("1.png", 1, 1, _A, 1.0), ("2.png", 2, 2, _A, 0.9), ("3.png", 2, 3, _A, 0.8),
          ("4.png", 3, 4, _B, 1.0), ("5.png", 4, 5, _A, 1.0), ("6.png", 4, 6, _B, 0.5)]


def test_fabricated_ijb_by_hand(tmp_path):
    # Template 4 = a + .5 b (detector weights) = (1.5,.5,.5)/sqrt3: cos with template 1 (a)
    # is 5/sqrt33 = .870, with template 3 (b) 1/sqrt33 = .174. Pairs: (1,2) same, cos 1;
    # (1,4) same, .870; (3,4) different, .174: separated, TAR 1 at every FAR. Without the
    # weights both would be 1/sqrt3 = .577 (a tie) and TAR@FAR<=.1 would be 0.5.
    pairs = [(1, 2, 1), (1, 4, 1), (3, 4, 0)]
    write_ijb(tmp_path / "IJBC", _FACES, pairs)
    meta = read_ijb_meta(tmp_path, "IJBC")  # IJB_release root accepted
    assert meta.names[3] == "4.png" and meta.templates.tolist() == [1, 2, 2, 3, 4, 4]
    assert meta.landmarks.shape == (6, 5, 2) and meta.face_scores[5] == 0.5
    rows = evaluate_ijb_dir(MeanColour(), tmp_path / "IJBC", "IJBC", batch_size=4,
                            device="cpu", image_norms=("kept", "unit"))
    assert list(rows) == ["IJBC/1:1/norm-kept", "IJBC/1:1/unit-norm"]
    out = rows["IJBC/1:1/norm-kept"]
    assert out["num_pairs"] == 3 and out["image_norm"] == "kept"
    # The colours are equal-norm under MeanColour, so the norm changes nothing here.
    assert rows["IJBC/1:1/unit-norm"]["tar@far=1e-01"] == 1.0
    assert {k: v for k, v in out.items() if k.startswith("tar")} == {
        f"tar@far={f:.0e}": 1.0 for f in (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)}


def test_cli_with_ijb(tmp_path, capsys):
    write_ijb(tmp_path / "ijb", _FACES, [(1, 2, 1), (1, 4, 1), (3, 4, 0)], target="ijbb")
    assert main(["--checkpoint", str(make_run(tmp_path)), "--ijb", str(tmp_path / "ijb"),
                 "--ijb-target", "IJBB", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "TAR@1e-06 (%)" in out[0] and out[2].split()[:2] == ["IJBB/1:1/norm-kept", "3"]


def _write_1n(meta, target="ijbc", galleries=("G1", "G2")):
    # One row per image, as IJB-C's lists have: templates repeat.
    rows = {galleries[0]: ["1,1,1.png"], galleries[1]: ["3,2,4.png", "3,2,4.png"],
            "probe_mixed": ["2,1,2.png", "2,1,3.png", "4,1,5.png", "4,1,6.png"]}
    for name, lines in rows.items():
        kind = "" if name == "probe_mixed" else "gallery_"
        (meta / f"{target}_1N_{kind}{name}.csv").write_text(
            "TEMPLATE_ID,SUBJECT_ID,FILENAME\n" + "\n".join(lines) + "\n")


def test_1n_by_hand(tmp_path):
    # Gallery: template 1 (a, subject 1), template 3 (b, subject 2). Probes of subject 1:
    # template 2 (a): cos 1 with its mate, -1/3 with b; template 4 (a + .5 b): .870 with its
    # mate, .174 with b. Both mates rank 1; non-mated .174 > -1/3, FPIR .5 keeps the top
    # one (ceil(2 * .5) = 1st) as threshold: both mates above it.
    write_ijb(tmp_path, _FACES, [(1, 2, 1), (3, 4, 0)])
    _write_1n(tmp_path / "meta")
    lists = read_ijb_1n_meta(tmp_path, "IJBC")
    assert lists.gallery_templates.tolist() == [1, 3]
    assert lists.gallery_subjects.tolist() == [1, 2]
    assert lists.probe_templates.tolist() == [2, 4] and lists.probe_subjects.tolist() == [1, 1]
    rows = evaluate_ijb_dir(MeanColour(), tmp_path, "IJBC", batch_size=4, device="cpu",
                            one_to_n=True)
    out = rows["IJBC/1:N/norm-kept"]
    assert out["rank1"] == 1.0 and out["num_probes"] == 2 and out["gallery_size"] == 2
    assert out["tpir@fpir=1e-01"] == 1.0 and out["image_norm"] == "kept"


def test_cli_1n_table_json_and_errors(tmp_path, capsys):
    write_ijb(tmp_path / "ijb", _FACES, [(1, 2, 1), (3, 4, 0)], target="ijbb")
    run, json_path = make_run(tmp_path), tmp_path / "out.json"
    args = ["--checkpoint", str(run), "--ijb", str(tmp_path / "ijb"), "--ijb-target", "IJBB",
            "--device", "cpu", "--ijb-1n", "--ijb-image-norm", "kept", "unit"]
    assert main(args) == 2  # the 1:N lists are missing
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert "ijbb_1N_gallery_S1.csv: missing" in err[0]
    _write_1n(tmp_path / "ijb" / "meta", "ijbb", ("S1", "S2"))
    assert main([*args, "--json", str(json_path)]) == 0
    tables = capsys.readouterr().out.split("\n\n")
    assert [line.split()[0] for line in tables[1].splitlines()[2:]] == [
        "IJBB/1:N/norm-kept", "IJBB/1:N/unit-norm"]
    assert "rank-1 (%)" in tables[1] and "TPIR@FPIR=1e-03 (%)" in tables[1]
    assert "rank-1 (%)" not in tables[0]
    saved = json.loads(json_path.read_text())
    assert saved["IJBB/1:1/unit-norm"]["image_norm"] == "unit"
    bad = tmp_path / "ijb" / "meta" / "ijbb_1N_probe_mixed.csv"
    bad.write_text("TEMPLATE_ID,SUBJECT_ID\n2,x\n")
    assert main(args) == 2
    assert "ijbb_1N_probe_mixed.csv: non-numeric template or subject id" in capsys.readouterr().err


def test_meta_errors(tmp_path):
    write_ijb(tmp_path, _FACES[:2], [(1, 2, 1)])
    with pytest.raises(DataError, match="target 'IJBX'"):
        read_ijb_meta(tmp_path, "IJBX")
    with pytest.raises(DataError, match="ijbb_face_tid_mid.txt: missing"):
        read_ijb_meta(tmp_path, "IJBB")
    f = tmp_path / "meta" / "ijbc_name_5pts_score.txt"
    f.write_text(f.read_text().replace("2.png", "9.png"))
    with pytest.raises(DataError, match=r"5pts_score.txt:2: image '9.png'"):
        read_ijb_meta(tmp_path, "IJBC")
