"""trainer.config.pace: the schema's GPU-sized defaults on a machine without a GPU are warned
about with the step's estimate; the CPU recipe is not. The forward flops it reads from
``trainer/plan_figures.json`` are the planner's fresh counts."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import yaml
from launch_helpers import ROOT

from offline import plan
from trainer import measured_figures
from trainer.config import ConfigWarning, Machine, load_config, pace
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


def test_the_default_backbone_on_a_cpu_warns_and_the_cpu_recipe_does_not(tmp_path):
    cpu = Machine(installed=frozenset({"deepspeed"}))
    path = tmp_path / "cfg.yaml"  # the schema's defaults (iresnet50, batch 128), no files
    path.write_text(yaml.safe_dump({"device": "cpu", "log": {"wandb": "disabled"},
                                    "data": {"source": "synthetic", "num_classes": 100}}))
    with pytest.warns(ConfigWarning) as caught:
        cfg = load_config(path, machine=cpu)
    [warned] = [str(w.message) for w in caught if "no GPU" in str(w.message)]
    assert warned.startswith("no GPU: one step of iresnet50 at train.batch_size=128 x "
                             "grad_accum=1 on 1 CPU rank(s) takes about "), warned
    assert cpu_pace_warning(cfg, Machine(gpus=1)) is None  # a GPU machine
    assert cpu_pace_warning(cfg.model_copy(update={"device": "cuda"}), cpu) is None
    smoke = ["data.source=synthetic", "data.num_classes=100", "log.wandb=disabled"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load_config(ROOT / "configs" / "smoke.yaml", smoke, machine=cpu.launching(2))


@pytest.mark.parametrize(("backbone", "batch", "seconds", "said"), [
    ("iresnet100", 64, 5e9 * 128 * 3 * 1e-9, "about 32.0 min"),  # 1,920 s
    ("iresnet100", 512, 5e9 * 1024 * 3 * 1e-9, "about 4.3 h"),  # 15,360 s
    ("iresnet_tiny", 64, 1e8 * 128 * 3 * 1e-9, None),  # 38.4 s: under a minute, no warning
])
def test_the_estimate_is_forward_flops_times_images_times_local_ranks(
        monkeypatch, tmp_path, backbone, batch, seconds, said):
    """Made-up figures (not the measured ones, which the defaults' estimate would only give
    back): 5e9 and 1e8 forward flops per image, 1e-9 CPU seconds per flop; grad_accum 2 and
    3 ranks on the node, each of which shares its CPU."""
    figures = dataclasses.replace(measured_figures.figures(),
                                  forward_flops={"iresnet100": int(5e9), "iresnet_tiny": int(1e8)},
                                  cpu_train_seconds_per_flop=1e-9)
    monkeypatch.setattr(pace, "figures", lambda: figures)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"device": "cpu", "data": {"source": "synthetic",
                                                              "num_classes": 100}}))
    cfg = load_config(path, [f"backbone.name={backbone}", f"train.batch_size={batch}",
                             "train.grad_accum=2"], resolve=False)
    machine = Machine().launching(3, nnodes=2)  # 6 ranks, 3 on this node
    assert cpu_step_seconds(cfg, machine) == pytest.approx(seconds)
    warned = cpu_pace_warning(cfg, machine)
    if said is None:
        assert warned is None
    else:
        assert warned.startswith(f"no GPU: one step of {backbone} at train.batch_size={batch} "
                                 f"x grad_accum=2 on 3 CPU rank(s) takes {said} here;"), warned
