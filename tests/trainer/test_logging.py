"""trainer.telemetry.logger.RunLogger: rank 0 alone writes; W&B offline by default,
WANDB_MODE wins."""

from __future__ import annotations

import importlib.machinery
import io
import json
import os
import re
import sys
import types

import pytest
import torch
from launch_helpers import make_config, train_in_process

from trainer.engine import StepResult
from trainer.stopping import StopRequest
from trainer.telemetry import run_files
from trainer.telemetry.logger import RunLogger, print_main

FIELDS = ("step", "loss", "lr", "scale", "theta_med", "b_avg", "cos_target_mean",
          "cos_nontarget_mean", "img_per_s", "memory_mb", "skipped_samples", "padded_samples")


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in ``wandb`` module recording its calls (no files, no network, no service)."""
    calls: dict = {"init": [], "log": [], "define_metric": [], "summary": {}, "finish": 0}

    class Run:
        def __init__(self, run_id: str):
            self.id, self.summary = run_id, calls["summary"]
            self.url = f"https://wandb.example/{run_id}"

        def log(self, data):
            calls["log"].append(data)

        def define_metric(self, name, **kwargs):
            calls["define_metric"].append((name, kwargs))

        def finish(self):
            calls["finish"] += 1

    def init(**kwargs):
        calls["init"].append(kwargs)
        return Run(kwargs["id"])

    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # "installed"
    module.init, module.Histogram = init, lambda np_histogram: np_histogram
    module.Settings = dict
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return calls


def _by_step(logged: list[dict]) -> dict[int, dict]:
    """W&B log calls merged per ``global_step`` (the x axis of every chart)."""
    out: dict[int, dict] = {}
    for data in logged:
        out.setdefault(data["global_step"], {}).update(data)
    return out


def _result(loss: float) -> StepResult:
    """An applied step's result with host numbers (the engine's hold device tensors)."""
    return StepResult(lr=0.1, skipped=False, overflow=False, stop=StopRequest(),
                      numbers={"loss": loss, "grad_norm": 1.0})


def _log_run(cfg, rank: int, start: int = 0, loss_at_0: float = 5.0) -> dict:
    """Steps ``start + 1 .. 4`` with loss ``loss_at_0 - step``; histograms at step 4."""
    log = RunLogger(cfg, rank, total_steps=4, global_batch=8)
    log.start(start)
    head_stats = {"scale": 30.0, "theta_med": 1.2, "b_avg": 5.0, "cos_target_mean": 0.3,
                  "cos_nontarget_mean": 0.01}
    for step in range(start + 1, 5):
        stats = _result(loss_at_0 - step)
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
    assert init["resume"] == "allow" and init["config"]["log"]["every"] == 2
    assert ("*", {"step_metric": "global_step"}) in fake_wandb["define_metric"]
    logged = _by_step(fake_wandb["log"])
    assert logged[2]["scale"] == 30.0 and logged[4]["loss"] == 1.0
    counts, edges = logged[4]["theta_target"]  # per degree, as in histograms.jsonl
    assert counts[0] == 5 and sum(counts) == 5 and len(edges) == 181
    assert fake_wandb["summary"]["steps"] == 4 and fake_wandb["finish"] == 1
    assert (tmp_path / "run" / "config.yaml").is_file()


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


def test_resume_truncates_metrics_and_histograms_to_the_checkpoint_step(tmp_path):
    cfg = make_config(f"output={tmp_path / 'run'}", "log.every=1", "log.hist_every=2",
                      "log.progress=false", "log.wandb=disabled")
    angles = {"theta_target": torch.tensor([10.0, 20.0]), "theta_nontarget": torch.tensor([90.0])}

    def steps(log, first, last):
        for step in range(first, last + 1):
            log.step(step, _result(1.0), {}, None, torch.device("cpu"))
            if log.wants_histograms(step):
                log.histograms(step, angles)

    log = RunLogger(cfg, 0, total_steps=6, global_batch=8)
    log.start(0)
    steps(log, 1, 5)  # interrupted after step 5; say the checkpoint is step 2
    log.close(5, None)
    log = RunLogger(cfg, 0, total_steps=6, global_batch=8)
    log.start(2)
    steps(log, 3, 6)
    summary = log.close(6, None)
    run = tmp_path / "run"
    assert [r["step"] for r in run_files.read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert run_files.read_histograms(run / "histograms.jsonl").steps.tolist() == [2, 4, 6]
    assert summary["steps"] == 6 and summary["steps_this_invocation"] == 4


def test_hist_every_zero_samples_no_histograms(tmp_path):
    cfg = make_config(f"output={tmp_path / 'run'}", "log.hist_every=0", "log.progress=false",
                      "log.wandb=disabled")
    log = RunLogger(cfg, 0, total_steps=4, global_batch=8)
    assert not any(log.wants_histograms(step) for step in range(1, 1000))
    log.start(0)
    log.close(0, None)
    assert not (tmp_path / "run" / "histograms.jsonl").exists()
    cfg = make_config("log.hist_every=3")
    log = RunLogger(cfg, 1, total_steps=4, global_batch=8)  # any rank: the sample is collective
    assert [s for s in range(1, 10) if log.wants_histograms(s)] == [3, 6, 9]


def _train(data, run, *overrides: str) -> int:
    return train_in_process(data, run, "log.hist_every=2", *overrides)


def test_resumed_training_keeps_one_wandb_run_and_no_duplicate_steps(synthetic_data, tmp_path,
                                                                     capsys, fake_wandb):
    import shutil

    run = tmp_path / "run"
    args = ("checkpoint.every=4", "log.wandb=offline")
    assert _train(synthetic_data, run, "train.max_steps=6", *args) == 0
    shutil.rmtree(run / "checkpoints" / "step-00000006")  # as if killed before that save
    capsys.readouterr()
    assert _train(synthetic_data, run, "train.max_steps=8", *args) == 0
    first, second = fake_wandb["init"]
    assert first["id"] == second["id"] and second["resume"] == "allow"
    assert (run / "wandb_run_id").read_text().strip() == first["id"]
    steps = [d["global_step"] for d in fake_wandb["log"] if "loss" in d]
    assert steps == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]  # W&B keeps the redone steps' last values
    out = capsys.readouterr()
    assert "metrics.jsonl: dropped 2 row(s) after step 4" in out.err
    assert out.out.count("summary: ") == 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["steps_this_invocation"] == 4
    steps = [r["step"] for r in run_files.read_jsonl(run / "metrics.jsonl")]
    assert steps == list(range(1, 9))
    assert run_files.read_histograms(run / "histograms.jsonl").steps.tolist() == [2, 4, 6, 8]


PLAIN = re.compile(r"^step (\d+)/4 \((\d+)%\) epoch 1 loss \d+\.\d{4} lr \S+ s 30\.00 "
                   r"theta_med \d\.\d{3} img/s \d+ ETA \d+:\d\d:\d\d mem \d+ MiB$")


def test_batch_log_gets_plain_lines_and_wandb_is_never_imported(synthetic_data, tmp_path):
    """A batch system's log: stderr is no TTY, so even with log.progress=true no bar."""
    import subprocess

    from launch_helpers import ROOT

    run = tmp_path / "run"
    script = ("import sys; from launch.train import main; rc = main(sys.argv[1:]); "
              "print('wandb imported:', 'wandb' in sys.modules); sys.exit(rc)")
    cmd = [sys.executable, "-c", script, "--config", str(ROOT / "configs" / "smoke.yaml"),
           f"data.dir={synthetic_data}", f"output={run}", "engine.type=ddp",
           "train.batch_size=8", "data.num_workers=0", "train.max_steps=4", "log.every=2",
           "log.progress=true", "log.wandb=disabled"]
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"} | {"OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "wandb imported: False" in out.stdout
    assert "\r" not in out.stderr and "step/s" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if PLAIN.match(line)]
    assert [PLAIN.match(line).groups() for line in lines] == [("2", "50"), ("4", "100")]
    logged = (run / "train.log").read_text().splitlines()
    assert sum(bool(PLAIN.match(line.split(" ", 2)[2])) for line in logged) == 2
    assert logged[-1].split(" ", 2)[2].startswith("summary: {")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_gets_a_bar_and_other_ranks_say_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    cfg = make_config(f"output={tmp_path / 'run'}", "log.every=2", "log.wandb=disabled")
    _log_run(cfg, rank=1)
    assert sys.stderr.getvalue() == "" and not (tmp_path / "run").exists()
    _log_run(cfg, rank=0)
    shown = sys.stderr.getvalue()
    assert "4/4" in shown and "loss=1.000 s=30.00" in shown
    assert "step 2/4 (50%)" not in shown  # the bar replaces the plain lines
    logged = (tmp_path / "run" / "train.log").read_text()
    assert "step 2/4 (50%)" in logged and "step 4/4 (100%)" in logged  # the file has them all


def test_tensorboard_holds_the_wandb_names(tmp_path, fake_wandb):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_config(f"output={tmp_path / 'run'}", "log.every=2", "log.progress=false",
                      "log.tensorboard=true")
    _log_run(cfg, rank=0)
    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    tags = events.Tags()
    assert [e.step for e in events.Scalars("loss")] == [2, 4]
    assert [e.value for e in events.Scalars("scale")] == [30.0, 30.0]
    (hist,) = events.Histograms("theta_target")
    assert hist.step == 4 and hist.histogram_value.num == 5
    wandb_names = {k for d in fake_wandb["log"] for k in d} - {"global_step"}
    assert set(tags["scalars"]) | set(tags["histograms"]) == wandb_names
    assert {"config/text_summary", "summary/text_summary"} <= set(tags["tensors"])  # add_text
    _log_run(cfg, rank=0, start=2, loss_at_0=9.0)  # resumed at step 2: 3 and 4 again
    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(2, 3.0), (4, 5.0)]


def test_missing_optional_packages_are_config_errors(synthetic_data):
    from launch_helpers import ROOT

    from trainer.config import ConfigError, Machine, load_config

    bare = Machine(installed=frozenset({"deepspeed"}))  # no tensorboard, no wandb
    args = [f"data.dir={synthetic_data}", "log.tensorboard=true", "log.wandb=offline"]
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs" / "smoke.yaml", args, machine=bare)
    assert str(err.value).splitlines() == [
        "command line: log.tensorboard=true: the tensorboard package is not installed "
        "(pip install 'partial-fc[tensorboard]', or log.tensorboard=false)",
        "command line: log.wandb='offline': the wandb package is not installed "
        "(pip install 'partial-fc[wandb]', or log.wandb=disabled)",
    ]
    wandb_off = Machine(installed=bare.installed, wandb_mode="disabled")  # WANDB_MODE wins
    load_config(ROOT / "configs" / "smoke.yaml", [f"data.dir={synthetic_data}"], machine=wandb_off)


_STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "


def test_warnings_and_the_fatal_error_land_in_train_log(synthetic_data, tmp_path, capsys):
    """What rank 0 says on stderr (a config warning, found before the run
    folder exists; the error that ends the run) is also in RUN/train.log, timestamped."""
    run = tmp_path / "run"
    rc = train_in_process(synthetic_data, run, "margin.s=1.0", "optim.lr=1e30",
                          "train.max_bad_steps=2", "train.max_steps=4")
    err = capsys.readouterr().err.splitlines()
    assert rc == 1
    said = [line for line in err if line.startswith(("warning:", "error:"))]
    assert any(line.startswith("warning: margin.s=1.0") for line in said), err
    assert any(line.startswith("error:") for line in said), err
    logged = (run / "train.log").read_text().splitlines()
    for line in said:
        assert [entry for entry in logged if re.fullmatch(_STAMP + re.escape(line), entry)], \
            (line, logged)


def test_a_bug_on_any_rank_lands_in_train_log_with_its_traceback(tmp_path, capsys):
    from trainer.failures import report_failure

    try:
        {}["boom"]
    except KeyError as err:
        assert report_failure(err, 3, tmp_path) == 1
    logged = (tmp_path / "train.log").read_text().splitlines()
    assert re.fullmatch(_STAMP + "rank 3: Traceback .*", logged[0]), logged
    assert re.fullmatch(_STAMP + "KeyError: 'boom'", logged[-1]), logged


def test_a_wandb_failure_drops_wandb_with_one_warning_and_the_run_goes_on(
        tmp_path, fake_wandb, monkeypatch, capsys):
    import wandb

    def broken(data):
        raise ConnectionError("wandb service died")

    def init(**kwargs):
        run = real_init(**kwargs)
        run.log = broken
        return run

    cfg = make_config(f"output={tmp_path / 'run'}", "log.every=1", "log.progress=false")
    real_init = wandb.init
    monkeypatch.setattr(wandb, "init", init)
    log = RunLogger(cfg, 0, total_steps=4, global_batch=8)
    log.start(0)
    for step in (1, 2, 3):
        log.step(step, _result(1.0), {}, None, device=torch.device("cpu"))
    assert not log.write_failed() and log.write_error is None
    warned = [line for line in capsys.readouterr().err.splitlines() if "W&B" in line]
    assert len(warned) == 1 and warned[0].startswith("warning:"), warned
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3]


def test_a_step_record_flattens_into_its_metrics_row():
    from partial_fc.metric_names import SCALE_DYNAMICS
    from trainer.telemetry.logger import StepRecord

    head = dict.fromkeys(SCALE_DYNAMICS, 1.5)
    record = StepRecord(step=3, loss=2.0, lr=0.1, grad_norm=0.5, head=head, img_per_s=10.0,
                        memory_mb=1.0, data={"bad_steps": 1}, time_s=4.0, epoch=0)
    row = record.row()
    assert list(row) == ["step", "loss", "lr", "grad_norm", *SCALE_DYNAMICS, "img_per_s",
                         "memory_mb", "bad_steps", "time_s", "epoch"]
    assert row["step"] == 3 and row["bad_steps"] == 1 and row[SCALE_DYNAMICS[0]] == 1.5
    assert "epoch" not in StepRecord(**{**record.__dict__, "epoch": None}).row()
