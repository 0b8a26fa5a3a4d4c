"""trainer.config.pace: the schema's GPU-sized defaults on a machine without a GPU are warned
about with the step's estimate; the CPU recipe is not. The forward flops it reads from
``trainer/plan_figures.json`` are the planner's fresh counts."""

from __future__ import annotations

import json
import warnings

import pytest
import yaml
from launch_helpers import ROOT

from offline import plan
from trainer import measured_figures
from trainer.config import ConfigWarning, Machine, load_config
from trainer.config.pace import cpu_pace_warning, cpu_step_seconds

# One of each family, and the backbone the CPU rate was measured on: a second of meta-device
# forwards. `make test-plan-full` counts the whole table.
SAMPLED_FLOPS = ["iresnet_tiny", "iresnet50", "mobilefacenet", "vit_t"]


def _stale_flops(names) -> dict:
    """``{name: (table, counted)}`` for each of ``names`` whose ``forward_flops`` entry differs
    from :func:`offline.plan.backbone_flops` at D=512 now."""
    table = measured_figures.figures().forward_flops
    counted = {name: plan.backbone_flops.__wrapped__(name, 512) for name in names}
    return {name: (table[name], counted[name]) for name in names if counted[name] != table[name]}


def test_a_sample_of_tabled_flops_matches_the_planner():
    assert not _stale_flops(SAMPLED_FLOPS)


@pytest.mark.plan_full
def test_every_tabled_flops_entry_matches_the_planner():
    stale = _stale_flops(measured_figures.figures().forward_flops)
    assert not stale, stale  # name: (table, counted)


def test_the_default_backbone_on_a_cpu_warns_with_the_estimate(tmp_path):
    cpu = Machine(installed=frozenset({"deepspeed"}))
    path = tmp_path / "cfg.yaml"  # the schema's defaults (iresnet50, batch 128), no files
    path.write_text(yaml.safe_dump({"device": "cpu", "log": {"wandb": "disabled"},
                                    "data": {"source": "synthetic", "num_classes": 100}}))
    with pytest.warns(ConfigWarning) as caught:
        cfg = load_config(path, machine=cpu)
    [warned] = [str(w.message) for w in caught if "no GPU" in str(w.message)]
    # the defaults' step
    measured = json.loads(measured_figures.FIGURES.read_text())["cpu_pace"]["step"]
    assert (cfg.backbone.name, cfg.train.batch_size) == (measured["backbone"], measured["batch"])
    assert warned.startswith("no GPU: one step of iresnet50 at train.batch_size=128 x grad_accum"
                             f"=1 on 1 CPU rank(s) takes about {measured['seconds'] / 60:.1f} min "
                             "here;")
    assert cpu_step_seconds(cfg, cpu) == pytest.approx(measured["seconds"])
    assert cpu_step_seconds(cfg, cpu.launching(2)) == pytest.approx(2 * measured["seconds"])
    assert cpu_pace_warning(cfg, Machine(gpus=1)) is None  # a GPU machine
    assert cpu_pace_warning(cfg.model_copy(update={"device": "cuda"}), cpu) is None
    smoke = ["data.source=synthetic", "data.num_classes=100", "log.wandb=disabled"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load_config(ROOT / "configs" / "smoke.yaml", smoke, machine=cpu.launching(2))
