"""Every launch error is seen once, in one line: ``make train`` checks the config, the data
folder and the batch in one process before torchrun starts (no rank can be killed before it
prints), and ``launch.torchrun`` ends a failed job with one line (the rank, its exit code,
where torchrun's report went) instead of torchrun's ``ChildFailedError`` block."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.testbed import harness as chaos


def _env() -> dict[str, str]:
    """The running test's environment (its cache folders, W&B off: tests/conftest.py), read
    when a process starts rather than when this module was imported."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(chaos.ROOT)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """12 samples: one step of batch 2 fits on 2 ranks, the smoke recipe's batch 32 does not."""
    return chaos.write_data(tmp_path_factory.mktemp("tiny"), num_classes=3, per_class=4)


def _make_train(data: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = ["make", "--no-print-directory", "train", f"PY={sys.executable}", "SETUP=",
           f"SMOKE_DATA={data}", "ARGS=" + " ".join(args)]
    return subprocess.run(cmd, cwd=chaos.ROOT, env=_env(), capture_output=True, text=True,
                          timeout=120)


def _lines(out: str, start: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(start)]


@pytest.mark.slow
def test_make_train_shows_each_bad_input_once_without_a_traceback(tiny, tmp_path):
    """Each of a bad key, a missing data folder and a batch the data cannot fill prints the
    project's line once and nothing of torchrun (it never starts: one process checks before
    the launch, so there is no rank to race and one try of each says it all; the refusal
    printed by the ranks of a plain launch is the next test's)."""
    cases = [
        (["optim.lrr=0.1", "train.batch_size=2"], "optim.lrr: unknown key (did you mean optim.lr?"),
        ([f"data.dir={tmp_path / 'nowhere'}", "train.batch_size=2"],
         f"data.dir='{tmp_path / 'nowhere'}': no such folder"),
        ([], "(at most 6 samples per rank); train.batch_size=6 is the largest that fits"),
    ]
    for args, expected in cases:
        done = _make_train(tiny, f"output={tmp_path / 'run'}", *args)
        out = done.stdout + done.stderr
        assert done.returncode != 0, out
        assert sum(expected in line for line in out.splitlines()) == 1, out
        assert "Traceback" not in out and "ChildFailedError" not in out, out
        assert "torchrun" not in done.stderr and not (tmp_path / "run").exists(), out


def _launch(data: Path, run: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc_per_node", "2",
           "-m", "launch.train", "--config", str(chaos.SMOKE), f"data.dir={data}",
           f"output={run}", *chaos.BASE_ARGS, *args]
    return subprocess.run(cmd, cwd=chaos.ROOT, env=_env(), capture_output=True, text=True,
                          timeout=240)


def test_plain_launcher_prints_the_refusal_once_and_one_line_of_its_own(tiny, tmp_path):
    """No ``--check`` first: both ranks refuse the config; local rank 0 prints it (rank 1
    lets it exit first), and the launch adds one line and exits 2, making no run folder."""
    run = tmp_path / "run"
    done = _launch(tiny, run, "optim.lrr=0.1", "train.batch_size=2")
    err = done.stderr
    assert done.returncode == 2, err
    assert len(_lines(err, "command line: optim.lrr: unknown key")) == 1, err
    ours = _lines(err, "launch: ")
    assert len(ours) == 1 and ours[0].startswith("launch: rank 0 (pid "), err
    assert ours[0].endswith("ended the job with exit code 2 (its input was refused; nothing "
                            "started)"), err
    assert "Traceback" not in err and "ChildFailedError" not in err and "FAILED" not in err
    assert not run.exists()


HOLDER = """
import sys, time
from trainer.run_lock import RunLock
RunLock(sys.argv[1], host="node-a").acquire()
print("holding", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.long  # a 2-rank launch, ~17 CPU-s; make test keeps rank 0's refusal of a held
# folder before any step (tests/trainer/test_run_lock.py) and make train's check of it
# (tests/e2e/test_busy_folder.py)
def test_a_job_refused_for_a_held_folder_writes_nothing_into_it(tiny, tmp_path):
    """The run folder is held by another job (on "node-a"), launched past the check ``make
    train`` runs first (``test_busy_folder.py``): rank 0 refuses in one line, the launch adds
    its own line saying nothing started, and exits 2; torchrun's report stays on this job's
    stderr, the other job's train.log and lease are left alone."""
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], env=_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        (run / "train.log").write_text("step 5/124 the running job's line\n")
        done = _launch(tiny, run, "train.batch_size=2")
    finally:
        holder.kill()
        holder.wait()
    err = done.stderr
    assert done.returncode == 2, err
    errors = _lines(err, "error")
    assert len(errors) == 1 and errors[0].startswith(
        f"error: {run} is in use by another job (pid {holder.pid} on node-a, since "), err
    ours = _lines(err, "launch: ")
    assert len(ours) == 1 and ours[0].startswith("launch: rank 0 (pid "), err
    assert ours[0].endswith("ended the job with exit code 2 (its input was refused; nothing "
                            "started)"), err
    assert "Traceback" not in err and "ChildFailedError" not in err
    assert (run / "train.log").read_text() == "step 5/124 the running job's line\n"
    assert '"host": "node-a"' in (run / ".lock").read_text()


def test_a_resume_folder_without_a_checkpoint_is_bad_input(tiny, tmp_path, capsys):
    """``checkpoint.resume=PATH`` naming a folder that holds no checkpoint exits 2, as every
    bad input, in one line."""
    from launch_helpers import train_in_process

    empty = tmp_path / "elsewhere"
    empty.mkdir()
    rc = train_in_process(tiny, tmp_path / "run", "train.batch_size=4",
                          f"checkpoint.resume={empty}")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert rc == 2 and errors == [f"error: checkpoint.resume='{empty}': no checkpoint there"]


def test_the_check_before_a_launch_leaves_the_warnings_to_the_run(tiny, capsys):
    """``make train`` / ``make <recipe>`` run ``--check --errors-only``: the run that follows
    prints the config's warnings, so they are not printed twice."""
    from launch.train import main

    args = ["--config", str(chaos.SMOKE), f"data.dir={tiny}", "train.batch_size=2",
            "margin.s=1.0"]  # below the NormFace bound: a theory warning
    assert main(["--check", *args]) == 0
    assert "warning: margin.s=1.0" in capsys.readouterr().err
    assert main(["--check", "--errors-only", *args]) == 0
    assert capsys.readouterr().err == ""
