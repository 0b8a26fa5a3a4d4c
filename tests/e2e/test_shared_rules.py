"""A rule a run, a plan and the head all state is written once (``partial_fc.head_checks``,
``trainer.config.checks``): ``launch.train --check``, ``launch.plan`` and ``PartialFC`` refuse
the same value with the same words, each naming the key in its own spelling."""

from __future__ import annotations

import pytest

from launch import plan as plan_cli
from launch.train import main as train
from partial_fc import PartialFC, build_margin
from tests.launch_helpers import ROOT

SMOKE = str(ROOT / "configs" / "smoke.yaml")


def _train_line(capsys, data, *overrides: str) -> list[str]:
    assert train(["--check", "--config", SMOKE, f"data.dir={data}", *overrides]) == 2
    return capsys.readouterr().err.splitlines()


def _plan_line(capsys, *argv: str) -> str:
    assert plan_cli.main(["--classes", "100", *argv]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


def _head_error(**kw) -> str:
    with pytest.raises(ValueError) as err:
        PartialFC(8, 10, build_margin({"type": "arcface"}), **kw)
    return str(err.value)


def _rule(line: str, key_value: str) -> str:
    """The words after ``key_value: `` in ``line``."""
    assert f"{key_value}: " in line, (key_value, line)
    return line.split(f"{key_value}: ", 1)[1]


@pytest.mark.parametrize(("run_key", "flag", "value", "rule"), [
    ("head.sample_rate", "--sample-rate", 1.5, "must be a finite number >= 0 and <= 1"),
    ("margin.subcenters", "--subcenters", 0, "must be an integer >= 1"),
])
def test_a_range_the_head_declares(capsys, synthetic_data, run_key, flag, value, rule):
    trained = _train_line(capsys, synthetic_data, f"{run_key}={value}")
    line = next(ln for ln in trained if f"{run_key}={value}" in ln)
    leaf = run_key.split(".")[1]
    said = {_rule(line, f"{run_key}={value}"),
            _rule(_plan_line(capsys, flag, str(value)), f"{flag}={value}"),
            _rule(_head_error(**{leaf: value}), f"{leaf}={value}")}
    assert said == {rule}


def test_a_plan_takes_sample_rate_0_as_a_run_does(capsys):
    assert plan_cli.main(["--classes", "100", "--sample-rate", "0"]) == 0


def test_sub_centers_on_the_triton_kernels(capsys, synthetic_data):
    """launch.plan has no kernel input: the run and the head say it."""
    trained = _train_line(capsys, synthetic_data, "margin.subcenters=3", "head.kernel=triton")
    line = next(ln for ln in trained if "K-way max" in ln)
    head = _head_error(subcenters=3, kernel="triton")
    assert _rule(line, "head.kernel='triton'") == ("the Triton kernels have no K-way max for "
                                                   "margin.subcenters=3 (use the auto or "
                                                   "torch kernel)")
    assert _rule(head, "kernel='triton'") == _rule(line, "head.kernel='triton'").replace(
        "margin.subcenters", "subcenters")


def test_fp16_needs_deepspeed(capsys, synthetic_data):
    trained = _train_line(capsys, synthetic_data, "engine.type=ddp", "engine.precision=fp16")
    line = next(ln for ln in trained if "needs engine.type=deepspeed" in ln)
    run = _rule(line, "engine.precision='fp16'")
    plan = _rule(_plan_line(capsys, "--precision", "fp16", "--engine", "ddp"), "--precision=fp16")
    assert run == "needs engine.type=deepspeed (its loss scaler; DDP has none)"
    assert plan == run.replace("engine.type", "--engine")
