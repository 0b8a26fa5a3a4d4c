"""launch.export --int8 on real faces (AT&T/ORL): the INT8 model is written with its cost
against fp32 on a .bin, and refused in one line when the cost passes --max-drop."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from eval_helpers import make_run

from data_pipeline.orl import write_orl_shards
from data_pipeline.orl_pairs import write_orl_verification_bin
from launch.export import main
from offline.int8 import calibration_images


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


def test_int8_needs_a_bin(tmp_path, capsys):
    run = make_run(tmp_path)
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(run), "--out", str(tmp_path / "m.onnx"), "--int8"])
    assert caught.value.code == 2 and "--bin" in capsys.readouterr().err
