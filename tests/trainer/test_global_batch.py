"""train.global_batch: the step's micro-batches derived from the world size
(trainer.config.accumulation), the checks that refuse a step the ranks cannot split or the
data cannot fill, and the key left out behaving as before."""

from __future__ import annotations

import pytest
import yaml

from trainer.config import ConfigError, Machine, load_config, resolve_config
from trainer.config.accumulation import accumulation, images_per_step, world_sizes
from trainer.config.machine import OPTIONAL_PACKAGES

CPU = Machine(installed=frozenset(OPTIONAL_PACKAGES))  # one CPU rank, every package


def _cfg(tmp_path, overrides=()):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"data": {"source": "synthetic", "num_classes": 64},
                                    "device": "cpu"}))
    return load_config(path, list(overrides), resolve=False)


def test_the_accumulation_follows_the_world_size_and_keeps_the_step(tmp_path):
    train = _cfg(tmp_path, ["train.batch_size=4", "train.global_batch=32"]).train
    assert world_sizes(train) == [1, 2, 4, 8]
    assert [accumulation(train, p) for p in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert {images_per_step(train, p) for p in (1, 2, 4, 8)} == {32}


def test_without_the_key_the_step_follows_the_ranks_as_before(tmp_path):
    train = _cfg(tmp_path, ["train.batch_size=4", "train.grad_accum=3"]).train
    assert train.global_batch is None and world_sizes(train) == []
    assert [accumulation(train, p) for p in (1, 2, 5)] == [3, 3, 3]
    assert [images_per_step(train, p) for p in (1, 2)] == [12, 24]


@pytest.mark.parametrize("overrides,fragment", [
    (["train.batch_size=4", "train.global_batch=30"],
     "train.global_batch=30: not a multiple of the micro-batch train.batch_size=4"),
    (["train.batch_size=4", "train.global_batch=32", "train.grad_accum=2"],
     "train.grad_accum=2: give train.global_batch or train.grad_accum, not both"),
    (["train.batch_size=4", "train.global_batch=32", "margin.type=elasticface_arc"],
     "train.global_batch=32: not with margin.type=elasticface_arc, whose margins are drawn"),
])
def test_a_global_batch_the_recipe_cannot_hold_is_refused(tmp_path, overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        _cfg(tmp_path, overrides)


def test_dynamic_adacos_is_refused_with_grad_accum_and_trains_with_global_batch(tmp_path):
    adacos = ["margin.type=adacos", "margin.adacos=dynamic", "train.batch_size=4"]
    with pytest.raises(ConfigError, match="train.grad_accum=2: not exact with dynamic AdaCos"):
        _cfg(tmp_path, [*adacos, "train.grad_accum=2"])
    assert _cfg(tmp_path, [*adacos, "train.global_batch=32"]).train.global_batch == 32


def test_a_world_size_that_cannot_split_the_step_is_refused_naming_those_that_can(tmp_path):
    cfg = _cfg(tmp_path, ["train.batch_size=4", "train.global_batch=48"])
    ok = [p for p in range(1, 14) if not resolve_config(cfg, None, CPU.launching(p)).errors]
    assert ok == [1, 2, 3, 4, 6, 12]
    (refused,) = resolve_config(cfg, None, CPU.launching(5)).errors
    assert refused == ("train.global_batch", "train.global_batch=48: 5 rank(s) cannot split its"
                       " 12 micro-batches of train.batch_size=4 evenly; launch 1, 2, 3, 4, 6, "
                       "12 rank(s), or change train.global_batch")


def test_a_step_larger_than_the_data_is_refused_on_any_world_size(tmp_path):
    # 64 classes x 4 images = 256 samples; a step of 512 cannot be filled
    cfg = _cfg(tmp_path, ["train.batch_size=4", "train.global_batch=512"])
    for ranks in (1, 2):
        (refused,) = resolve_config(cfg, None, CPU.launching(ranks)).errors
        assert refused[0] == "train.global_batch" and "cannot fill one step" in refused[1]
    fits = _cfg(tmp_path, ["train.batch_size=4", "train.global_batch=256"])
    assert resolve_config(fits, None, CPU).errors == []
