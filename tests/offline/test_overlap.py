"""Train/test overlap (``offline.overlap``, ``python -m launch.overlap``): identities planted
into a verification set are found, 2 ranks agree with one process, the CLI writes an
exclusion list and calibrates its threshold. Every evaluation format end to end, a folder at
a URL: ``test_overlap_formats.py``.

The embedding of the planted-identity test is built, not trained: random Fourier features
(Rahimi & Recht, NIPS 2007: cos(Wx + b)) of an 8x8 colour pooling, whose cosine approximates
a Gaussian kernel on the pooled colours. The synthetic identities are colour
fields (data_pipeline.synthetic), so this embedding reveals identity the way a trained face
model does (same identity: cosine near 1, others near 0), at no training cost; what is tested
is the tool: the centres streamed over the shards, the thresholding, the per-set counts.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from eval_helpers import make_run, write_ijb
from PIL import Image
from spawn import run_ranks
from torch import nn

from data_pipeline.codec import decode_image
from data_pipeline.exclusion import read_exclusions
from data_pipeline.synthetic import SyntheticSource
from data_pipeline.verification_bin import write_bin
from offline.overlap.calibration import NullChoice, calibrate
from offline.overlap.centres import class_centres, null_cosines
from offline.overlap.eval_sets import bin_images, ijb_images
from offline.overlap.matches import nearest_samples, queries, set_overlap

PLANTED = (3, 7, 11, 15, 19)  # of the 20 training identities (conftest's synthetic_data)
THRESHOLD = 0.5  # a fixed cosine where the calibration is not what is tested
FPIR = 0.05


class ColourFeatures(nn.Module):
    """``cos(pool8(x) W / 4 + b)``, 1024 features, fixed by a seed."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(192, 1024, generator=g) / 4.0, requires_grad=False)
        self.b = nn.Parameter(torch.rand(1024, generator=g) * 2 * torch.pi, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cos(F.adaptive_avg_pool2d(x, 8).flatten(1) @ self.w + self.b)


@functools.cache
def evaluation_images() -> list[bytes]:
    """4 unseen images of each planted identity, then 160 of 40 identities never trained on
    (another seed)."""
    same = SyntheticSource(20, 16, seed=0)  # images 8.. of an identity: not in the shards
    other = SyntheticSource(40, 4, seed=1)
    return [same.read(c * 16 + i)[0] for c in PLANTED for i in range(8, 12)] + \
        [other.read(i)[0] for i in range(160)]


def ijb_crop(blob: bytes) -> np.ndarray:
    """A 250x250 loose crop holding the face at 1.5x scale where ``write_ijb``'s landmarks
    put it."""
    canvas = np.zeros((250, 250, 3), np.uint8)
    face = Image.fromarray(decode_image(blob)).resize((168, 168), Image.BILINEAR)
    canvas[30:198, 20:188] = np.asarray(face)
    return canvas


def _overlap(data, images):
    """The calibrated search of one process or rank: every training image a null probe
    (160), the threshold at FPIR 0.05, then the planted set (4 unseen images of each planted
    identity) and the disjoint one (160 images of 40 identities never trained on)."""
    model = ColourFeatures()
    trained = class_centres(model, data, 32, "cpu", null=NullChoice(1.0))
    calibration = calibrate(*null_cosines(trained, "cpu"), FPIR, "the training images")
    sets = [bin_images("planted", "p.bin", images[:20]),
            bin_images("disjoint", "d.bin", images[20:])]
    found = [set_overlap(s, model, trained.centres, calibration.threshold, 32, "cpu")
             for s in sets]
    nearest = nearest_samples(model, data, queries(sets[:1], found[:1]), 32, "cpu")
    return trained.centres, trained.counts, calibration, found, nearest


def _check(counts, calibration, found, nearest) -> None:
    """Planted: every identity found by all its images, matched to its own training image.
    Disjoint: at most the images the FPIR expects listed, and no more identities than
    images."""
    planted, disjoint = found
    assert counts.tolist() == [8.0] * 20
    assert calibration.searches == 160 and calibration.reached == 8  # floor(0.05 * 161)
    assert planted.classes == set(PLANTED) and planted.matched_images == 20
    for match, near in zip(planted.matches, nearest, strict=True):  # its own images, its own
        assert match.image // 4 == PLANTED.index(match.label)  # class's training image
        assert near.source.split("/")[0] == str(match.label)
        assert near.score > calibration.threshold
    expected = calibration.expected_fpir * disjoint.images
    assert disjoint.images == 160 and expected == pytest.approx(8 * 160 / 161)
    assert len(disjoint.classes) <= disjoint.matched_images <= expected


def test_planted_sets_are_found_and_disjoint_ones_list_at_most_the_expected(synthetic_data):
    _, counts, calibration, found, nearest = _overlap(synthetic_data, evaluation_images())
    _check(counts, calibration, found, nearest)


def _ranks(rank, world, data, images):
    return _overlap(data, images)


def test_two_ranks_agree_with_one_process(synthetic_data):
    """The same null probes (chosen by key), threshold and lists on 2 ranks as on one."""
    images = evaluation_images()
    centres, counts, calibration, found, nearest = _overlap(synthetic_data, images)
    for c, n, cal, f, near in run_ranks(_ranks, world_size=2, args=(synthetic_data, images)):
        _check(n, cal, f, near)
        np.testing.assert_allclose(c, centres, atol=1e-6)
        np.testing.assert_allclose(cal.null, calibration.null, atol=1e-5)
        assert cal.threshold == pytest.approx(calibration.threshold, abs=1e-5)
        for mine, one in zip(f, found, strict=True):
            assert [(m.label, m.image) for m in mine.matches] == [
                (m.label, m.image) for m in one.matches]
            assert [m.score for m in mine.matches] == pytest.approx(
                [m.score for m in one.matches])
            np.testing.assert_allclose(mine.best, one.best, atol=1e-5)
        assert [(x.key, x.source) for x in near] == [(x.key, x.source) for x in nearest]


def test_cli_writes_an_exclusion_list(synthetic_data, tmp_path, capsys):
    from launch.overlap.__main__ import main

    run = make_run(tmp_path)
    images = evaluation_images()[:40]  # the planted ones
    write_bin(tmp_path / "lfw.bin", images, [True] * 20)
    out = tmp_path / "overlap.txt"
    assert main(["--checkpoint", str(run), "--data", str(synthetic_data), "--bins",
                 str(tmp_path / "lfw.bin"), "--threshold", "-1", "--out", str(out),
                 "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    listed = read_exclusions(out)  # the list, its notes included, read back by data.exclude
    assert set(PLANTED) <= listed.classes and not listed.samples  # and the strangers' nearest
    assert f"lfw  40      40              {len(listed.classes):<17d}  -" in printed
    assert out.read_text().startswith(f"# launch.overlap checkpoint={run} data=")
    assert "\nclass 3  # 3: lfw lfw.bin[" in out.read_text()  # synthetic: named by label


def test_planted_identities_are_found_in_an_ijb_folder(synthetic_data, tmp_path):
    """IJB faces are aligned from their landmarks first (``write_ijb`` puts the 112x112 face
    at 1.5x scale into a 250x250 crop): the planted identities 3 and 7 are still found."""
    images = evaluation_images()
    blobs = images[0:2] + images[4:6] + images[20:28]  # identities 3 and 7, then 8 others
    faces = [(f"{i}.png", i, i, ijb_crop(b), 1.0) for i, b in enumerate(blobs)]
    write_ijb(tmp_path / "IJBC", faces, [(0, 1, 1)])
    model = ColourFeatures()
    centres = class_centres(model, synthetic_data, 32, "cpu").centres
    found = set_overlap(ijb_images(tmp_path / "IJBC", "IJBC"), model, centres, THRESHOLD, 5,
                        "cpu")
    assert found.classes == {3, 7} and found.matched_images == 4 and found.images == 12


def test_cli_calibrates_for_the_search_it_makes(synthetic_data, tmp_path, capsys,
                                               monkeypatch):
    """No --threshold: the line names the threshold, the FPIR, the searches and whose; the
    table and the JSON give each set's expected false count beside its listed one, and the
    histograms (the null's: one count per search; a set's: one per image); the page draws
    them. --training-null: the training images are the probes, with the note that they run
    optimistic; --held-out: the held-out classes' images are. An FPIR the searches or their
    identities cannot resolve (known from the folder's size, before its pass), a list
    without classes or with a label the folder lacks: one line."""
    import launch.overlap.__main__ as overlap
    from launch.overlap import against_eval_sets

    monkeypatch.setattr(against_eval_sets, "load_backbone_or_exit", lambda path: ColourFeatures())
    write_bin(tmp_path / "disjoint.bin", evaluation_images()[20:], [False] * 80)
    out, js, page = tmp_path / "o.txt", tmp_path / "o.json", tmp_path / "o.html"
    args = ["--checkpoint", str(make_run(tmp_path)), "--data", str(synthetic_data), "--bins",
            str(tmp_path / "disjoint.bin"), "--out", str(out), "--device", "cpu"]
    assert overlap.main([*args, "--fpir", "0.05", "--training-null", "--json", str(js),
                         "--html", str(page)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("threshold ") and (
        ": the FPIR 0.05 (--fpir) of a search of the training images, each against the other "
        "identities' centres: reached by 8 of 160 searches of 20 identities (expected FPIR "
        "0.05;") in printed[0]
    found = json.loads(js.read_text())
    assert f"{found['threshold']:.4f}" == printed[0].split()[1].rstrip(":")
    calibration = found["calibration"]
    assert calibration["searches"] == 160 and sum(calibration["null_histogram"]) == 160
    assert calibration["reached"] == 8 and calibration["fpir"] == 0.05
    (disjoint,) = found["sets"]
    assert disjoint["images"] == sum(disjoint["histogram"]) == 160
    assert disjoint["expected_false"] == pytest.approx(8 / 161 * 160)
    assert disjoint["shared_identities"] <= disjoint["matched_images"] <= 8
    assert printed[1] == against_eval_sets.TRAINED_PROBES
    assert printed[3] == (f"disjoint  160     {disjoint['matched_images']:<14d}  "
                          f"{disjoint['shared_identities']:<17d}  <= 8")
    assert "<svg" in page.read_text() and "reached by 8 of 160 searches" in page.read_text()
    assert "fpir=0.05" in out.read_text().splitlines()[0]

    held = tmp_path / "held.txt"
    held.write_text("".join(f"class {c}\n" for c in range(10)))
    assert overlap.main([*args, "--fpir", "0.1", "--held-out", str(held)]) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert (f"a search of the images of the 10 identities held out of training (--held-out "
            f"{held}), each against the other identities' centres: reached by 8 of 80 "
            "searches of 10 identities") in first
    assert second.startswith("set ")  # no note: these probes were never trained on
    assert overlap.main([*args, "--fpir", "0.05", "--held-out", str(held)]) == 2
    assert "are of at most 10 identities" in capsys.readouterr().err  # 1/11 at best

    assert overlap.main([*args, "--fpir", "0.001", "--training-null"]) == 2
    assert capsys.readouterr().err == (
        "error: --fpir 0.001: at most 160 null searches (the training images) resolve rates "
        "down to 1/161 = 0.0062 only; raise --fpir, search more images (--null-images) or set "
        "--threshold\n")  # refused before the pass over the shards: the folder has 160
    held.write_text("class 20\n")
    assert overlap.main([*args, "--held-out", str(held)]) == 2
    assert capsys.readouterr().err == (
        f"error: --held-out {held}: class 20 is not a label of {synthetic_data} (20 classes)\n")
    held.write_text("sample 000000001\n")
    with pytest.raises(SystemExit):
        overlap.main([*args, "--held-out", str(held)])
    assert f"--held-out {held}: no `class` lines" in capsys.readouterr().err


def test_cli_calibrates_on_the_identities_the_run_held_out(synthetic_data, tmp_path, capsys,
                                                         monkeypatch):
    """No --held-out: the run's own data.exclude (RUN/config.yaml) names the null probes, in
    one line, and gives the threshold --held-out with the same list gives. A run that held
    no identity out is refused in one line naming the fixes."""
    import launch.overlap.__main__ as overlap
    from launch.overlap import against_eval_sets
    from offline.overlap.held_out import FIX

    monkeypatch.setattr(against_eval_sets, "load_backbone_or_exit", lambda path: ColourFeatures())
    write_bin(tmp_path / "disjoint.bin", evaluation_images()[20:], [False] * 80)
    run, held = make_run(tmp_path), tmp_path / "held.txt"
    held.write_text("".join(f"class {c}\n" for c in range(10)) + "sample 000000170\n")
    args = ["--checkpoint", str(run), "--data", str(synthetic_data), "--bins",
            str(tmp_path / "disjoint.bin"), "--out", str(tmp_path / "o.txt"), "--device", "cpu",
            "--fpir", "0.1", "--json", str(tmp_path / "o.json")]
    config = run / "config.yaml"
    config.write_text(config.read_text() + yaml.safe_dump(
        {"data": {"dir": str(synthetic_data), "exclude": str(held)}}))
    assert overlap.main(args) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    source = f"{run}'s data.exclude={held}"
    assert first == ("null probes: the images of the 10 identities held out of training "
                     f"({source}), which the model never saw")
    assert f"held out of training ({source}), each against" in second
    automatic = json.loads((tmp_path / "o.json").read_text())["threshold"]
    assert overlap.main([*args, "--held-out", str(held)]) == 0
    assert json.loads((tmp_path / "o.json").read_text())["threshold"] == automatic

    config.write_text(config.read_text().replace(f"exclude: {held}", "exclude: null"))
    capsys.readouterr()
    assert overlap.main(args) == 2
    assert capsys.readouterr().err == (
        f"error: {run} trained on every identity of {synthetic_data} (no data.exclude), so no "
        f"image of it is an unseen person's: {FIX}\n")


def test_the_run_s_held_out_list_is_its_folder_s(tmp_path):
    """data.dirs: the list parallel to the folder searched; a folder the run did not train
    on, a list of single samples, and one that cannot be read where the tool runs: refused,
    each in one line naming the way on."""
    from offline.overlap.calibration import CalibrationError
    from offline.overlap.held_out import run_held_out

    (tmp_path / "a.txt").write_text("class 4\nclass 2\n")
    (tmp_path / "b.txt").write_text("sample 000000001\n")
    config = tmp_path / "run" / "config.yaml"
    config.parent.mkdir()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")

    def held(data, exclude):
        config.write_text(yaml.safe_dump({"data": {"dirs": [a, b], "exclude": exclude}}))
        return run_held_out(config, data)

    found = held(str(tmp_path / "x" / ".." / "a"), [str(tmp_path / "a.txt"), None])
    assert found.classes == {2, 4} and found.source.endswith(f"data.exclude={tmp_path}/a.txt")
    with pytest.raises(CalibrationError, match=rf"^{config.parent} trained on {a}, {b}, not "
                       r"--data /elsewhere: pass --held-out LIST"):
        held("/elsewhere", [str(tmp_path / "a.txt"), None])
    with pytest.raises(CalibrationError, match=r"has no `class` lines\), so no image"):
        held(b, [None, str(tmp_path / "b.txt")])
    with pytest.raises(CalibrationError, match=r"data.exclude=gone.txt, the identities it "
                       r"held out, cannot be read here .* or pass --held-out LIST$"):
        held(a, "gone.txt")
