"""bench/arcface_torch_pace.py on CPU: what it does to run arcface_torch's train_v2.py unchanged.

insightface is not vendored and the tests reach no network, so a stand-in ``train_v2.py`` in
the layout of ``recognition/arcface_torch`` takes the real one's place: it reads its config
as ``utils/utils_config.get_config`` does (``configs.base``, then the named module over it),
imports the modules the bench may stand in for, and logs ``Speed`` lines as arcface_torch's
``CallBackLogging`` formats them. What runs on the GPU is the real script (the pace stage).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from launch_helpers import bench_module

TRAIN_V2 = '''
import importlib, os, sys
import mxnet
from easydict import EasyDict
from torch.utils.tensorboard import SummaryWriter

cfg = importlib.import_module("configs.base").config
cfg.update(importlib.import_module("configs." + os.path.basename(sys.argv[1])).config)
assert os.path.isfile("train_v2.py") and sys.path[0] == os.getcwd()
SummaryWriter(log_dir=cfg.output).add_scalar("loss", 1.0, 1)
os.makedirs(cfg.output, exist_ok=True)
with open(os.path.join(cfg.output, "training.log"), "w") as f:
    for speed in (90.0, 300.0, 1000.0, 1200.0, 1100.0):
        f.write(f"Training: 2026-11-28 Speed {speed:.2f} samples/sec   Loss 40.0000   "
                f"LearningRate 0.100000   Epoch: 0   Global Step: 10   Fp16 Grad Scale: 65536\\n")
with open(os.path.join(cfg.output, "seen.json"), "w") as f:
    import json
    json.dump(dict(cfg), f)
if cfg.sample_rate < 1:
    raise KeyboardInterrupt  # as the bench's alarm does mid-step
'''
BASE = "from easydict import EasyDict as edict\nconfig = edict()\nconfig.network = 'r50'\n" \
       "config.fp16 = False\nconfig.num_workers = 2\nconfig.momentum = 0.9\n"


@pytest.fixture
def arcface_torch(tmp_path, monkeypatch):
    """A stand-in checkout; the modules its run imports are dropped again afterwards. The
    modules the bench may stand in for count as absent (importing sklearn or tensorboard
    costs seconds; the stand-ins are what is tested)."""
    import torch.utils

    for name in bench_module("arcface_torch_pace")._stubs():
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(torch.utils, "tensorboard", None, raising=False)
    folder = tmp_path / "insightface" / "recognition" / "arcface_torch"
    (folder / "configs").mkdir(parents=True)
    (folder / "train_v2.py").write_text(TRAIN_V2)
    (folder / "configs" / "__init__.py").write_text("")
    (folder / "configs" / "base.py").write_text(BASE)
    (tmp_path / "insightface" / "COMMIT").write_text("7fadd420c2351d0ffa8cac403421c1a3ed733365\n")
    before = set(sys.modules)
    yield tmp_path / "insightface"
    for name in set(sys.modules) - before:
        where = getattr(sys.modules[name], "__file__", None)
        if where is None or str(tmp_path) in where or "arcface-torch-" in where:  # its copy
            del sys.modules[name]


@pytest.mark.parametrize("rate", [1.0, 0.1])
def test_train_v2_runs_on_synthetic_input_and_its_speed_is_read(arcface_torch, tmp_path, rate):
    module = bench_module("arcface_torch_pace")
    where = os.getcwd(), sys.path[:], sys.argv[:]
    out = tmp_path / "arcface.json"
    code = module.main(["--insightface", str(arcface_torch), "--json", str(out),
                        "--classes", "1000", "--sample-rate", str(rate), "--batch", "64",
                        "--seconds", "60", "--skip", "2"])
    assert code == 0 and (os.getcwd(), sys.path, sys.argv) == where
    result = json.loads(out.read_text())
    assert result["img_per_s"] == 1100.0 and result["speeds"] == [1000.0, 1200.0, 1100.0]
    assert result["error"] is None
    assert result["insightface_commit"] == "7fadd420c2351d0ffa8cac403421c1a3ed733365"
    assert "config.rec = 'synthetic'" in result["config"]


def test_the_config_overrides_base_with_the_runs_shape_only(arcface_torch, tmp_path):
    module = bench_module("arcface_torch_pace")
    module.stub_missing()
    source = module.config_source(93_431, 0.1, 128, tmp_path / "out", 8)
    namespace: dict = {}
    exec(compile(source, "pace_r50.py", "exec"), namespace)  # noqa: S102 - our own source
    cfg = namespace["config"]
    assert (cfg.rec, cfg.network, cfg.num_classes, cfg.sample_rate, cfg.batch_size) == (
        "synthetic", "r50", 93_431, 0.1, 128)
    assert cfg.fp16 is True and cfg.val_targets == [] and cfg.margin_list == (1.0, 0.5, 0.0)
    assert Path(cfg.output) == tmp_path / "out"


def test_a_stand_in_fails_loudly_if_the_run_uses_it(arcface_torch):
    module = bench_module("arcface_torch_pace")
    assert "mxnet" in module.stub_missing()
    import mxnet

    with pytest.raises(RuntimeError, match="mxnet.recordio.MXIndexedRecordIO: a stand-in"):
        mxnet.recordio.MXIndexedRecordIO("train.idx", "train.rec", "r")
