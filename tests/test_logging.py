"""launch.logging.RunLogger: rank 0 alone writes; W&B offline by default, WANDB_MODE wins."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from launch_helpers import make_config

from launch.logging import RunLogger, print_main

FIELDS = ("step", "loss", "lr", "scale", "theta_med", "b_avg", "cos_target_mean",
          "cos_nontarget_mean", "img_per_s", "memory_mb", "skipped_samples", "padded_samples")


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in ``wandb`` module recording init/log calls (no files, no network)."""
    calls: dict[str, list] = {"init": [], "log": []}

    class Run:
        summary: dict = {}

        def log(self, data, step):
            calls["log"].append((step, data))

        def finish(self):
            calls["finish"] = True

    def init(**kwargs):
        calls["init"].append(kwargs)
        return Run()

    module = types.SimpleNamespace(init=init, Histogram=lambda values: ("hist", len(values)))
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return calls


def _log_run(cfg, rank: int) -> dict:
    log = RunLogger(cfg, rank, total_steps=4, global_batch=8)
    log.start(0)
    head_stats = {"scale": 30.0, "theta_med": 1.2, "b_avg": 5.0, "cos_target_mean": 0.3,
                  "cos_nontarget_mean": 0.01}
    for step in range(1, 5):
        stats = {"loss": 5.0 - step, "lr": 0.1, "grad_norm": 1.0}
        data = {"skipped_samples": 2, "padded_samples": 1} if log.due(step) else None
        log.step(step, stats, head_stats, data, device=torch.device("cpu"))
    log.histograms(4, {"theta_target": torch.rand(5), "theta_nontarget": torch.rand(7)})
    return log.close(4, None)


def test_rank0_writes_metrics_and_wandb_offline_by_default(tmp_path, fake_wandb):
    cfg = make_config(f"output={tmp_path / 'run'}", "log.every=2", "log.progress=false")
    assert _log_run(cfg, rank=1) == {}
    assert not (tmp_path / "run").exists() and fake_wandb["init"] == []  # rank 1: nothing
    summary = _log_run(cfg, rank=0)
    assert summary["steps"] == 4 and summary["loss_last"] == 1.0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        assert all(isinstance(r[k], int | float) for k in FIELDS), r
    assert records[0]["scale"] == 30.0 and records[0]["skipped_samples"] == 2
    (init,) = fake_wandb["init"]
    assert init["mode"] == "offline" and init["dir"] == str(tmp_path / "run")
    logged = dict(fake_wandb["log"])
    assert logged[2]["scale"] == 30.0 and logged[4]["theta_target"] == ("hist", 5)
    assert fake_wandb["finish"] and (tmp_path / "run" / "config.yaml").is_file()


def test_wandb_mode_env_wins(tmp_path, fake_wandb, monkeypatch):
    cfg = make_config(f"output={tmp_path / 'run'}", "log.progress=false", "log.wandb=online")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    _log_run(cfg, rank=0)
    assert fake_wandb["init"] == [] and (tmp_path / "run" / "metrics.jsonl").is_file()
    monkeypatch.delenv("WANDB_MODE")
    _log_run(cfg, rank=0)
    assert [c["mode"] for c in fake_wandb["init"]] == ["online"]


def test_print_main_only_on_rank0(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    print_main("hello")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    print_main("hello")
    assert capsys.readouterr().err == "hello\n"
