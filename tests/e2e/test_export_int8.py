"""launch.export --int8 on real faces (AT&T/ORL): the INT8 model is written with its cost
against fp32 on a .bin or an IJB folder (ORL's faces laid out as one), and refused in one
line when the cost passes --max-drop."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from eval_helpers import make_run, write_ijb
from PIL import Image

from data_pipeline.codec import decode_image, prepare_jpeg, resolve_decoder
from data_pipeline.orl import find_orl_root, write_orl_shards
from data_pipeline.orl_pairs import orl_pairs, write_orl_verification_bin
from launch.export import main
from offline.int8 import calibration_images
from trainer.evaluation import evaluate_ijb_dir
from trainer.onnx_backbone import OnnxBackbone


def _orl_as_ijb(root):
    """s31-s40 as an IJB-C folder: each image its own template and media, pasted where
    ``write_ijb``'s landmarks put the aligned crop (1.5x scale at (20, 30)), the pairs of
    ``orl.bin`` (450 genuine, 450 impostor)."""
    faces, decoder = [], resolve_decoder("auto")
    for n, (i, k) in enumerate((i, k) for i in range(31, 41) for k in range(1, 11)):
        pgm = (find_orl_root() / f"s{i}" / f"{k}.pgm").read_bytes()
        face = Image.fromarray(decode_image(prepare_jpeg(pgm, 112), 112, decoder))
        canvas = np.zeros((250, 250, 3), np.uint8)
        canvas[30:198, 20:188] = np.asarray(face.resize((168, 168), Image.BILINEAR))
        faces.append((f"{i}_{k}.png", n + 1, n + 1, canvas, 1.0))
    template = {(i, k): 10 * (i - 31) + k for i in range(31, 41) for k in range(1, 11)}
    pairs = [(template[a], template[b], int(same)) for a, b, same in orl_pairs(range(31, 41), 450)]
    write_ijb(root, faces, pairs)
    return root


@pytest.fixture(scope="module")
def orl(tmp_path_factory):
    root = tmp_path_factory.mktemp("orl")
    write_orl_shards(root / "shards", identities=["s1", "s2", "s3"], samples_per_shard=10)
    return root / "shards", write_orl_verification_bin(root / "pairs.bin")


def test_calibration_images_spread_over_every_shard(orl):
    shards, _ = orl
    images = calibration_images(shards, 6)  # 30 images in 3 shards: positions 0, 6, 12, ...
    assert images.shape == (6, 3, 112, 112) and images.dtype == np.uint8
    assert len({im.tobytes() for im in images}) == 6
    assert np.array_equal(calibration_images(shards, 6), images)  # deterministic


@pytest.mark.slow
def test_int8_is_written_with_its_cost_or_refused(tmp_path, capsys, orl):
    shards, pairs = orl
    run = make_run(tmp_path)
    out = tmp_path / "model.onnx"
    args = ["--checkpoint", str(run), "--out", str(out), "--int8", "--bin", str(pairs),
            "--calibration-data", str(shards), "--calibration-samples", "16"]
    assert main([*args, "--max-drop", "100"]) == 0
    printed = capsys.readouterr().out
    costs = {m[0]: float(m[1]) for m in re.findall(r"pairs (\S+?)\*?: fp32 .* cost (\S+) pp",
                                                   printed)}
    assert set(costs) == {"accuracy", "tar@far=1e-03", "tar@far=1e-04"}, printed
    int8 = tmp_path / "model.int8.onnx"
    ops = {node.op_type for node in onnx.load(str(int8)).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops  # static QDQ: ranges are constants
    assert int8.stat().st_size < out.stat().st_size / 2

    bound = max(costs.values()) - 0.01  # just below the measured cost: refused
    assert main([*args, "--max-drop", str(bound)]) == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: INT8 costs ")
    assert f"> --max-drop {bound}" in errors[0]
    assert not int8.exists() and out.exists()


# make test-long: the int8 export and its cost on a .bin are make test's (above), the IJB
# evaluator's figures tests/eval's; this walks the two together (26 CPU-s).
@pytest.mark.slow
@pytest.mark.long
def test_int8_cost_on_an_ijb_folder_is_the_evaluators_ijb_figures(tmp_path, capsys, orl):
    shards, _ = orl
    ijb = _orl_as_ijb(tmp_path / "IJBC")
    out = tmp_path / "model.onnx"
    args = ["--checkpoint", str(make_run(tmp_path)), "--out", str(out), "--int8", "--ijb",
            str(ijb), "--calibration-data", str(shards), "--calibration-samples", "16"]
    assert main([*args, "--max-drop", "100"]) == 0
    found = re.findall(r"^IJBC/1:1/norm-kept (\S+?)\*?: fp32 (\S+)  int8 (\S+)  cost (\S+) pp$",
                       capsys.readouterr().out, re.MULTILINE)
    fp32 = evaluate_ijb_dir(OnnxBackbone(out), ijb, "IJBC", 64, "cpu")["IJBC/1:1/norm-kept"]
    int8 = evaluate_ijb_dir(OnnxBackbone(tmp_path / "model.int8.onnx"), ijb, "IJBC", 64,
                            "cpu")["IJBC/1:1/norm-kept"]
    assert [k for k, *_ in found] == sorted(k for k in fp32 if k.startswith("tar@far="))
    for key, a, b, cost in found:  # what launch.evaluate --ijb reports for each model
        assert float(a) == pytest.approx(100 * fp32[key], abs=0.006)
        assert float(b) == pytest.approx(100 * int8[key], abs=0.006)
        assert float(cost) == pytest.approx(float(a) - float(b), abs=0.011)

    worst = max(float(cost) for *_, cost in found)
    assert main([*args, "--max-drop", str(worst - 0.01)]) == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and "on IJBC/1:1/norm-kept (> --max-drop" in errors[0]
    assert not (tmp_path / "model.int8.onnx").exists()


def test_int8_refuses_an_unreadable_ijb_folder_before_exporting(tmp_path, capsys):
    out = tmp_path / "model.onnx"
    assert main(["--checkpoint", str(make_run(tmp_path)), "--out", str(out), "--int8",
                 "--ijb", str(tmp_path / "nowhere"), "--calibration-data", str(tmp_path)]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and str(tmp_path / "nowhere") in errors[0]
    assert not out.exists()


def test_int8_needs_a_bin(tmp_path, capsys):
    run = make_run(tmp_path)
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(run), "--out", str(tmp_path / "m.onnx"), "--int8"])
    assert caught.value.code == 2 and "--bin" in capsys.readouterr().err
