"""trainer.preemption: when a stop signal waits for the step's end and when it stops the run
at once, and the bound on a rank that outlives its launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from launch_helpers import ROOT

from tools.testbed.harness import running
from trainer.preemption import LAUNCHER_SIGNAL, LAUNCHER_WATCH, Interrupted, StopSignals
from trainer.stopping import StopReason, StopRequest, StopRequests


@pytest.fixture(autouse=True)
def python_sigint():
    """SIGINT as a Python started from a terminal has it (KeyboardInterrupt): a suite that a
    shell started in the background inherits SIGINT ignored, and these tests' Ctrl-C would
    reach nothing."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


class Clock:
    """``(steps done, start of the current step)`` as the loop reports them."""

    def __init__(self):
        self.steps, self.started = 0, time.monotonic()

    def __call__(self) -> tuple[int, float]:
        return self.steps, self.started


def test_a_signal_near_the_step_end_waits_for_it_a_second_stops_now(monkeypatch):
    from trainer import preemption

    monkeypatch.setattr(preemption, "SAME_SIGNAL_S", 0.2)
    clock = Clock()
    with StopSignals(clock) as signals:
        clock.steps, clock.started = 3, time.monotonic()  # 3 quick steps done, the 4th runs
        signal.raise_signal(signal.SIGTERM)
        assert signals.stops.current().signum == signal.SIGTERM  # for the step's agreement
        signal.raise_signal(signal.SIGTERM)  # the same job-wide signal, forwarded: no effect
        time.sleep(0.3)
        with pytest.raises(Interrupted, match=r"step 4: interrupted by a second stop signal "
                                              r"\(SIGINT\); .* the last checkpoint stays"):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_a_signal_in_the_first_step_or_far_from_the_step_end_stops_now():
    clock = Clock()
    with StopSignals(clock) as signals, pytest.raises(
            Interrupted, match=r"step 1: interrupted by SIGUSR1 in the first step this process "
                               r"runs \(nothing new to save\)"):
        signal.raise_signal(signal.SIGUSR1)
    assert not signals.stops.current()
    with StopSignals(clock) as signals:
        # one step took 100 s (the loop began 100 s before it); the second began just now
        clock.steps, clock.started = 1, time.monotonic()
        signals._entered = (0, clock.started - 100.0)
        with pytest.raises(Interrupted, match=r"SIGTERM about (99|100) s before the step's end"):
            signal.raise_signal(signal.SIGTERM)


def test_after_the_last_step_a_signal_lets_the_run_end_a_second_stops_it(monkeypatch):
    """Once ``total`` steps are done (the last save, evaluation and summary run) a signal
    has nothing to stop: it must not kill the rank (a finished job would fail), nor raise
    for a step to come, however slow the steps were; a second one still ends it at once."""
    from trainer import preemption

    monkeypatch.setattr(preemption, "SAME_SIGNAL_S", 0.2)
    clock = Clock()
    with StopSignals(clock, total=6) as signals:
        signals._entered = (0, clock.started - 600.0)  # 100 s a step: the pace rule is moot
        clock.steps, clock.started = 6, time.monotonic()
        signal.raise_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(Interrupted, match=r"^after step 6, the last: interrupted by a "
                                              r"second stop signal \(SIGTERM\); the run's end "
                                              r".* is cut short, the last checkpoint stays"):
            signal.raise_signal(signal.SIGTERM)


def test_the_launchers_death_reaches_the_runs_own_requests_and_no_other(monkeypatch):
    """The run's holder is the one the handlers were given: a second run's holder (another
    run in the same process) sees nothing of the first's."""
    monkeypatch.setattr(LAUNCHER_WATCH, "parent", 7)
    monkeypatch.setattr(LAUNCHER_WATCH, "reported", False)
    clock = Clock()
    ours, another = StopRequests(), StopRequests()
    with StopSignals(clock, ours) as signals:
        signals._entered = (0, clock.started - 2.0)  # one step done at a 1 s pace
        clock.steps, clock.started = 2, time.monotonic()
        signal.raise_signal(LAUNCHER_SIGNAL)
    assert ours.current() == StopRequest(StopReason.LAUNCHER_GONE)
    assert ours.detail == "the launcher's death (pid 7)" and LAUNCHER_WATCH.reported
    ours.request(StopReason.LAUNCHER_GONE, "a later report")  # the first detail stays
    assert ours.detail == "the launcher's death (pid 7)" and not another.current()


# A "launcher" that starts a "rank" and waits; the rank watches it, and cannot stop by itself:
# it ignores the launcher's death signal (PR_SET_PDEATHSIG's) as a rank stuck in a
# collective would.
RANK = """
import os, signal, sys, time
from trainer.preemption import LAUNCHER_SIGNAL, LAUNCHER_WATCH
signal.signal(LAUNCHER_SIGNAL, signal.SIG_IGN)
assert LAUNCHER_WATCH.start(grace_s=2.0)
print("watching", flush=True)
time.sleep(120)
"""
LAUNCHER = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(rank.pid, flush=True)
time.sleep(120)
"""


def test_a_rank_that_cannot_stop_ends_itself_after_the_grace_period():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHELASTIC_RUN_ID": "test"}
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LAUNCHER),
                                 textwrap.dedent(RANK)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    rank = int(launcher.stdout.readline())
    assert launcher.stdout.readline().strip() == "watching"
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    killed = time.monotonic()
    while time.monotonic() - killed < 30 and running(rank):
        time.sleep(0.2)
    ended = not running(rank)
    if not ended:
        os.kill(rank, signal.SIGKILL)
    err = launcher.stderr.read()
    assert ended, err
    assert f"error: the launcher (pid {launcher.pid}) died 2 s ago and this rank (pid {rank}) " \
           "has not stopped; ending it" in err


def test_ctrl_c_before_the_step_loop_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    import launch.train
    from tools.testbed.harness import write_data

    def interrupted(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C while the process group starts

    monkeypatch.setattr(launch.train, "init_distributed", interrupted)
    rc = launch.train.main(["--config", str(ROOT / "configs" / "smoke.yaml"),
                            f"data.dir={write_data(tmp_path / 'data', per_class=1)}",
                            f"output={tmp_path / 'run'}", "log.wandb=disabled",
                            "train.batch_size=4"])
    assert rc == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: interrupted by SIGINT outside the step loop; the last checkpoint stays: run the "
        "same command again to resume from it")
