"""The step's one decision (``trainer.engine.backend.Verdict``) and the stop requests it
carries (``trainer.stopping``): what every rank agrees on, and what the loop does with it."""

from __future__ import annotations

import signal

import pytest
import torch
from launch_helpers import make_config
from spawn import run_ranks

from trainer.engine.backend import Verdict
from trainer.errors import classify
from trainer.stopping import StopReason, StopRequest, StopRequested, StopRequests

ASKS = [  # rank -> (finite, its stop request)
    (True, StopRequest(StopReason.SIGNAL, int(signal.SIGUSR1))),
    (False, StopRequest(StopReason.DISK_FULL)),
    (True, StopRequest(StopReason.SIGNAL, int(signal.SIGTERM))),
]


def _agree(rank: int, world: int) -> tuple:
    finite, stop = ASKS[rank]
    verdict = Verdict.agree(torch.tensor(finite), stop, group=None)
    return verdict.read(), bool(verdict.apply), verdict.applies


def test_every_rank_reads_the_same_verdict_with_the_largest_stop_request():
    out = run_ranks(_agree, 3, timeout=120)
    largest_signal = max(int(signal.SIGUSR1), int(signal.SIGTERM))
    expected = ((False, StopRequest(StopReason.DISK_FULL, largest_signal)), False, False)
    assert out == [expected] * 3


def test_a_verdict_for_the_step_applies(one_rank_group):
    verdict = Verdict.agree(torch.tensor(True), StopRequest(), group=None)
    assert verdict.read() == (True, StopRequest()) and verdict.applies
    assert not StopRequest() and StopRequest(StopReason.LOCK_LOST)


def test_requests_keep_the_largest_reason_and_its_detail():
    stops = StopRequests()
    assert stops.current() == StopRequest()
    stops.request(StopReason.LOCK_LOST, "another job took runs/x")
    stops.signal(int(signal.SIGTERM))  # the handler's one write
    assert stops.current() == StopRequest(StopReason.LOCK_LOST, int(signal.SIGTERM))
    alone = StopRequests()
    alone.signal(int(signal.SIGUSR1))
    assert alone.current() == StopRequest(StopReason.SIGNAL, int(signal.SIGUSR1))
    assert stops.detail == "another job took runs/x"
    assert [r for r in StopReason if r.saves] == [StopReason.SIGNAL, StopReason.LAUNCHER_GONE]


@pytest.mark.parametrize("reason", [r for r in StopReason if r and not r.saves])
def test_a_stop_without_checkpoint_ends_every_rank_with_one_line(reason, tmp_path):
    """The loop's error for each reason that writes no checkpoint: exit 1, reported once by
    rank 0, naming the step and how to resume (not when the folder is another job's now); the
    asking rank's detail when it is rank 0."""
    from trainer.loop import stop_error
    from trainer.run_state import Run
    from trainer.telemetry.logger import RunLogger, WriteFailed

    cfg = make_config(f"output={tmp_path}", "log.progress=false")
    log = RunLogger(cfg, 1, total_steps=10, global_batch=8)
    run = Run(cfg, env=None, engine=None, loader=None, log=log, total=10, steps_per_epoch=10,
              step=4)
    run.stops.request(reason, "what happened here")
    err = stop_error(run, StopRequest(reason))
    assert isinstance(err, WriteFailed if reason is StopReason.DISK_FULL else StopRequested)
    report = classify(err, rank=0)
    assert report.exit_code == 1 and report.prints and not classify(err, rank=1).prints
    assert "step 4: " in report.text
    assert ("resume" in report.text) is (reason is not StopReason.LOCK_LOST)
    if reason is not StopReason.DISK_FULL:
        assert "what happened here" in report.text
