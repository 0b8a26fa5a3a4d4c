"""What ``launch.train`` says when a setting is overruled or mistyped: ``train.max_steps``
that ``train.epochs`` never reaches, a schedule that jumps when a finished run is extended,
the start line's run and margin, and "did you mean" / an example for a bad value."""

from __future__ import annotations

import pytest

from launch.train import main as train
from tests.launch_helpers import ROOT, train_in_process


def test_an_enum_typo_and_a_type_error_say_what_was_meant(capsys):
    assert train(["--check", "--config", str(ROOT / "configs" / "smoke.yaml"),
                  "margin.type=arcfce", "train.batch_size=abc"]) == 2
    err = capsys.readouterr().err
    assert "command line: margin.type='arcfce': not one of normface|" in err
    assert "(did you mean 'arcface'?)" in err
    assert "train.batch_size='abc': Input should be a valid integer (e.g. " \
        "train.batch_size=128)" in err


@pytest.mark.slow
def test_overruled_settings_get_one_line_naming_the_key(tmp_path, synthetic_data):
    """160 samples at batch 32: 5 steps an epoch. max_steps=50 with epochs=1 ends at 5; the
    finished run extended to 2 epochs restarts the decay from a higher lr."""
    run = tmp_path / "run"
    assert train_in_process(synthetic_data, run, "train.batch_size=32", "train.epochs=1",
                            "train.max_steps=50") == 0
    log = (run / "train.log").read_text()
    assert "note: train.max_steps=50 is not reached: train.epochs=1 ends the run first, at " \
        "step 5" in log
    assert f"smoke ({run}): margin cosface s=30 m=0.35; 1 rank(s) on cpu, 5 steps" in log
    assert train_in_process(synthetic_data, run, "train.batch_size=32", "train.epochs=2") == 0
    log = (run / "train.log").read_text()
    assert "note: the learning rate jumps at step 5 from 0 (the saved run's schedule) to " in log
    assert "because of train.epochs 1 -> 2, train.max_steps 50 -> None" in log
