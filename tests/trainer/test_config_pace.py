"""trainer.config.pace: the schema's GPU-sized defaults on a machine without a GPU are warned
about with the step's estimate; the CPU recipe is not."""

from __future__ import annotations

import warnings

import pytest
import yaml
from launch_helpers import ROOT

from trainer.config import ConfigWarning, Machine, load_config
from trainer.config.pace import FORWARD_GFLOPS, cpu_pace_warning, cpu_step_seconds


@pytest.mark.parametrize("name", ["iresnet_tiny", "mobilefacenet", "vit_t"])
def test_tabled_flops_match_the_planner(name):
    from trainer.plan import backbone_flops

    assert FORWARD_GFLOPS[name] == pytest.approx(backbone_flops(name, 512) / 1e9, abs=0.01)


def test_the_default_backbone_on_a_cpu_warns_with_the_estimate(tmp_path):
    cpu = Machine(installed=frozenset({"deepspeed"}))
    path = tmp_path / "cfg.yaml"  # the schema's defaults (iresnet50, batch 128), no files
    path.write_text(yaml.safe_dump({"device": "cpu", "log": {"wandb": "disabled"},
                                    "data": {"source": "synthetic", "num_classes": 100}}))
    with pytest.warns(ConfigWarning) as caught:
        cfg = load_config(path, machine=cpu)
    [warned] = [str(w.message) for w in caught if "no GPU" in str(w.message)]
    assert warned.startswith("no GPU: one step of iresnet50 at train.batch_size=128 x "
                             "grad_accum=1 on 1 CPU rank(s) takes about 1.4 min here;")
    assert cpu_step_seconds(cfg, cpu) == pytest.approx(84)
    assert cpu_pace_warning(cfg, Machine(gpus=1)) is None  # a GPU machine
    assert cpu_pace_warning(cfg.model_copy(update={"device": "cuda"}), cpu) is None
    smoke = ["data.source=synthetic", "data.num_classes=100", "log.wandb=disabled"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load_config(ROOT / "configs" / "smoke.yaml", smoke, machine=cpu.launching(2))
