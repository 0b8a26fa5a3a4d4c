"""What a user sees of a run on a terminal: the bar, then one summary line and nothing from
W&B; a rerun of a finished run in one line; no third-party noise."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys

from launch_helpers import ROOT, train_in_process


class _Terminal(io.StringIO):
    """stdout and stderr of a terminal, as one screen (the bar is drawn on stderr)."""

    def isatty(self) -> bool:
        return True


def _terminal(monkeypatch) -> _Terminal:
    """Called in the test itself: pytest resets sys.stdout/stderr between fixtures and test."""
    screen = _Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the default: W&B offline
    return screen


def _train(data, run, *overrides: str) -> int:
    return train_in_process(data, run, "train.max_steps=3", "schedule.warmup_epochs=0",
                            "log.progress=true", "log.every=2", *overrides)


def test_the_bar_is_closed_then_one_summary_line_and_nothing_from_wandb(
        synthetic_data, tmp_path, monkeypatch):
    terminal = _terminal(monkeypatch)
    run = tmp_path / "run"
    assert _train(synthetic_data, run, "log.tensorboard=true") == 0
    screen = terminal.getvalue()
    assert "3/3" in screen and (run / "wandb").is_dir()  # a bar was drawn, W&B ran
    lines = screen.split("\n")
    summaries = [i for i, line in enumerate(lines) if "summary:" in line]
    assert len(summaries) == 1, screen
    summary = lines[summaries[0]]
    assert summary.startswith("summary: "), summary  # on a line of its own, after the bar
    assert "\r" not in "\n".join(lines[summaries[0]:])  # the bar is not redrawn below it
    assert not [line for line in lines if line.startswith("wandb:")], screen
    # rounded figures and what to run next
    saved = json.loads((run / "summary.json").read_text())
    assert f"loss {saved['loss_first']:.4g} -> {saved['loss_last']:.4g}" in summary
    assert str(saved["loss_last"]) not in summary or len(str(saved["loss_last"])) <= 6
    for step in (f"checkpoint {saved['checkpoint']}", f"python -m launch.report {run}",
                 f"wandb sync {run}/wandb/offline-run-*", f"tensorboard --logdir {run}/tb"):
        assert step in summary, (step, summary)


def test_a_finished_run_run_again_says_so_in_one_line(synthetic_data, tmp_path, monkeypatch,
                                                      capsys):
    run = tmp_path / "run"
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert _train(synthetic_data, run, "log.progress=false") == 0
    wandb_runs = sorted((run / "wandb").glob("offline-run-*"))
    metrics = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert _train(synthetic_data, run, "log.progress=false") == 0
    out = capsys.readouterr()
    assert out.out == ""
    (line,) = out.err.splitlines()
    assert line.startswith(f"{run} already finished at step 3;")
    assert "`train.max_steps=6`" in line and "`checkpoint.resume=none`" in line
    assert sorted((run / "wandb").glob("offline-run-*")) == wandb_runs  # no empty W&B run
    assert (run / "metrics.jsonl").read_text() == metrics
    assert _train(synthetic_data, run, "log.progress=false", "train.max_steps=6") == 0
    assert "summary: " in capsys.readouterr().out  # the way on it names trains on


def test_deepspeed_warns_nothing_about_our_optimizer(synthetic_data, tmp_path):
    """DeepSpeed's "ZeRO with an untested optimizer" line: dropped (our SGD is checked against
    DDP in tests/trainer/test_engine.py); anything else DeepSpeed warns about still shows.
    The run is its own process: DeepSpeed keeps the first process group it sees, so a run in
    a pytest worker that already held another group fails for reasons of its own."""
    from trainer.engine.deepspeed_backend import _TestedHere

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "launch.train", "--config", str(ROOT / "configs" / "smoke.yaml"),
         f"data.dir={synthetic_data}", f"output={tmp_path / 'run'}", "engine.type=deepspeed",
         "train.batch_size=8", "data.num_workers=0", "train.max_steps=1",
         "log.progress=false"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "untested optimizer" not in out.stdout + out.stderr

    drop = _TestedHere()  # what the DeepSpeed backend installs on DeepSpeed's logger
    messages = ["You are using ZeRO with an untested optimizer, proceed with caution",
                "another warning"]
    kept = [m for m in messages if drop.filter(logging.makeLogRecord({"msg": m}))]
    assert kept == ["another warning"]


def test_a_warm_up_longer_than_the_run_warns_in_one_line(synthetic_data, tmp_path, capsys):
    """20 steps per epoch here (160 images, batch 8): a warm-up of 0.5 epochs is 10 steps."""
    assert _train(synthetic_data, tmp_path / "a", "log.progress=false",
                  "schedule.warmup_epochs=0.5", "train.max_steps=10") == 0
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]
    assert "schedule.warmup_epochs=0.5, 10 steps" in line and "(10 steps)" in line
    assert "train.max_steps" in line
    assert _train(synthetic_data, tmp_path / "b", "log.progress=false",
                  "schedule.warmup_epochs=0.5", "train.max_steps=11") == 0
    assert "warning:" not in capsys.readouterr().err
