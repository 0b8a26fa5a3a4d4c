"""trainer.errors: every user error's kind decides its exit code and which ranks report it;
anything else is a bug with its traceback; a real gloo failure counts as a failed collective.

Checked on types and the report's fields, not on message wording (the end-to-end wording is
in tests/e2e/test_faults.py and tools/chaos).
"""

from __future__ import annotations

import importlib
import pkgutil
import time
from datetime import timedelta

import pytest
import torch
from spawn import run_ranks

from data_pipeline.errors import CorruptImageError, DataError, ShardError
from launch.report import ReportError
from offline.plan import PlanError
from trainer.checkpoint import CheckpointError
from trainer.config import ConfigError
from trainer.engine.deepspeed_backend import LossScaleFloor
from trainer.errors import (
    BadData,
    Refused,
    Scope,
    Stopped,
    UserError,
    classify,
    collective_detail,
    is_collective_failure,
)
from trainer.failures import CollectiveFailed, report_failure
from trainer.loop import Diverged
from trainer.telemetry.logger import WriteFailed
from trainer.telemetry.run_files import RunFileError

PACKAGES = ("partial_fc", "data_pipeline", "trainer", "launch")


def _user_errors() -> list[type[UserError]]:
    """Every UserError class the packages define (each module imported), found from the
    code, not a hand-kept list: a new error type is checked the day it is added."""
    for name in PACKAGES:
        package = importlib.import_module(name)
        for module in pkgutil.walk_packages(package.__path__, f"{name}."):
            importlib.import_module(module.name)
    found, todo = set(), [UserError]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.add(sub)
            todo.append(sub)
    return sorted(found - {Refused, Stopped}, key=lambda c: (c.__module__, c.__name__))


ERRORS = _user_errors()


def test_the_error_table_is_found_from_the_code():
    assert {ConfigError, PlanError, RunFileError, CheckpointError, WriteFailed, Diverged,
            LossScaleFloor, CollectiveFailed, ReportError, BadData} <= set(ERRORS)


@pytest.mark.parametrize("error", ERRORS, ids=[e.__name__ for e in ERRORS])
def test_each_user_error_has_its_kinds_exit_code_and_scope_through_a_real_raise(error):
    """Exactly one kind: Refused exits 2, Stopped exits 1; what ``classify`` makes of the
    raised error on ranks 0 and 1 follows the class's scope: one line, from rank 0 alone for
    an error every rank raises, from the rank that met it otherwise."""
    assert issubclass(error, Refused) != issubclass(error, Stopped), error
    code = 2 if issubclass(error, Refused) else 1
    assert error.exit_code == code
    for rank in (0, 1):
        try:
            raise error("what and where")
        except UserError as err:
            report = classify(err, rank)
        assert (report.kind, report.exit_code, report.scope) == (error, code, error.scope)
        assert report.prints == (error.scope is Scope.ONE_RANK or rank == 0), rank
        assert len(report.text.splitlines()) == 1 and report.logged == report.text
        assert (f"on rank {rank}:" in report.text) == (error.scope is Scope.ONE_RANK)


def test_a_bad_config_or_checkpoint_reaches_a_handler_of_the_builtin(tmp_path):
    """What the public calls raise for a bad value is also a ``ValueError`` (the kinds'
    declared builtin bases), so a library user's ``except ValueError`` around a config load or
    a checkpoint check catches it, with its one line."""
    from launch_helpers import ROOT

    from trainer.checkpoint import verify
    from trainer.config import load_config

    with pytest.raises(ValueError) as config:
        load_config(ROOT / "configs" / "smoke.yaml", ["train.batch_size=0"], resolve=False)
    with pytest.raises(ValueError) as checkpoint:
        verify(tmp_path)  # a folder with no meta.json
    assert type(config.value) is ConfigError and "train.batch_size" in str(config.value)
    assert type(checkpoint.value) is CheckpointError and "meta.json" in str(checkpoint.value)


@pytest.mark.parametrize("error", [DataError, ShardError, CorruptImageError])
def test_data_errors_are_reported_by_the_rank_that_met_them(error):
    report = classify(error("shard-000001.tar: sample 7 has label 25"), 3)
    assert (report.kind, report.exit_code, report.scope, report.prints) == \
        (BadData, 1, Scope.ONE_RANK, True)
    assert report.text.endswith(": shard-000001.tar: sample 7 has label 25"), report.text


def test_a_data_error_from_a_loader_worker_is_still_one_line():
    """torch's DataLoader re-raises a worker's exception through ``ExceptionWrapper``, with
    the worker's traceback in its message (done here in-process: a real worker's shutdown
    costs seconds)."""
    from torch._utils import ExceptionWrapper

    try:
        raise ShardError("shard-000003.tar: truncated")
    except ShardError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(ShardError) as caught:
        wrapped.reraise()
    assert "Traceback" in str(caught.value)  # what torch does to the message
    report = classify(caught.value, 1)
    assert report.kind is BadData and report.prints and report.exit_code == 1
    assert report.text.splitlines() == [report.text]
    assert report.text.endswith("rank 1: shard-000003.tar: truncated"), report.text


def test_anything_else_is_a_bug_with_its_traceback_from_every_rank():
    try:
        {}["boom"]
    except KeyError as err:
        bug = err
    for rank in (0, 2):
        report = classify(bug, rank)
        assert (report.kind, report.exit_code, report.prints) == (None, 1, True)
        assert report.text.startswith("Traceback") and report.text.rstrip().endswith("'boom'")
        assert report.logged == f"rank {rank}: {report.text}"
    assert classify(RuntimeError("a collective timeout"), 0).kind is None


def test_report_failure_prints_logs_and_returns_the_code(tmp_path, capsys):
    assert report_failure(ConfigError("optim.lr=-1: must be > 0"), 0, tmp_path) == 2
    assert report_failure(Diverged("step 3: diverges"), 1, tmp_path) == 1  # rank 0 says it
    assert report_failure(CollectiveFailed("step 4: timed out"), 1, tmp_path) == 1
    err = capsys.readouterr().err.splitlines()
    logged = (tmp_path / "train.log").read_text().splitlines()
    assert len(err) == 2 and len(logged) == 2
    assert all(entry.endswith(line) for entry, line in zip(logged, err, strict=True))


def test_collective_failures_are_told_by_type_not_by_words():
    location = "[/src/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
    assert is_collective_failure(torch.distributed.DistBackendError("NCCL watchdog"))
    assert is_collective_failure(torch.distributed.DistNetworkError("store"))
    assert is_collective_failure(RuntimeError(location + "Connection closed by peer"))
    assert is_collective_failure(RuntimeError("Application timeout caused pair closure"))
    assert collective_detail(RuntimeError(location + "Connection closed")) == "Connection closed"
    # Words alone, another location of gloo (its own checks), or another type: not one.
    assert not is_collective_failure(RuntimeError("timeout: NCCL gloo Connection reset"))
    assert not is_collective_failure(RuntimeError("[/src/gloo/gloo/allreduce.cc:7] mismatch"))
    assert not is_collective_failure(ValueError(location + "Connection closed by peer"))
    assert not is_collective_failure(Diverged(location))
    assert not is_collective_failure(RuntimeError("Application timeout caused pair closure: x"))


def _failed(work) -> tuple[str, bool, type | None]:
    """(type name, is_collective_failure, classify's kind) of what ``work()`` raises."""
    try:
        work()
    except Exception as err:  # noqa: BLE001 - what torch raises is what is checked
        return type(err).__name__, is_collective_failure(err), classify(err, 0).kind
    raise AssertionError("the collective did not fail")


def _gloo_failures(rank: int, world: int) -> dict:
    """Rank 0's view of gloo's three failures: a peer that never joins (2 s group timeout),
    another operation pending when that happens, and a peer that closes its connections."""
    import torch.distributed as dist

    out = {}
    late = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    if rank == 0:
        first = dist.all_reduce(torch.ones(2), group=late, async_op=True)
        time.sleep(0.5)
        second = dist.all_reduce(torch.ones(2), group=late, async_op=True)
        out["pending"] = _failed(second.wait)  # first's receive times out first
        out["timeout"] = _failed(first.wait)
    else:
        time.sleep(5)
    gone = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    if rank == 0:
        out["closed"] = _failed(lambda: dist.all_reduce(torch.ones(2), group=gone))
    else:
        time.sleep(1)
        dist.destroy_process_group(gone)  # closes rank 1's side of the group's connections
        del gone
    return out


@pytest.mark.slow
def test_real_gloo_failures_are_collective_failures():
    """torch 2.13 raises a plain RuntimeError for all three (gloo's transport has no type of
    its own; trainer.errors.is_collective_failure says how they are told); the loop turns
    them into CollectiveFailed. Unwrapped, they would be a bug's traceback."""
    out, _ = run_ranks(_gloo_failures, 2, timeout=90)
    assert out == dict.fromkeys(("pending", "timeout", "closed"), ("RuntimeError", True, None))


def _peer_missing_while_building(rank: int, world: int, run: str) -> tuple | None:
    """Rank 1 never joins the engine's first collective (DDP's parameter broadcast on a group
    with a 3 s timeout); rank 0's ``train`` reports where it was."""
    import torch.distributed as dist
    from launch_helpers import ROOT

    from trainer.config import load_config
    from trainer.dist import DistEnv
    from trainer.loop import train

    group = dist.new_group([0, 1], timeout=timedelta(seconds=3))
    if rank == 1:
        time.sleep(6)
        return None
    cfg = load_config(ROOT / "configs" / "smoke.yaml",
                      ["data.source=synthetic", "data.num_classes=20", "engine.type=ddp",
                       f"output={run}", "log.wandb=disabled", "log.progress=false",
                       "data.num_workers=0"])
    try:
        train(cfg, DistEnv(0, 2, 0, torch.device("cpu"), group))
    except CollectiveFailed as err:
        return str(err).split(":")[0], classify(err, 0).exit_code
    raise AssertionError("train went on without its peer")


@pytest.mark.slow
def test_a_peer_lost_before_the_first_step_is_one_line(tmp_path):
    """Not only the step loop: a collective failing while the engine is built (or resumed,
    or the last checkpoint saved) is a CollectiveFailed naming that phase, not a traceback."""
    out, _ = run_ranks(_peer_missing_while_building, 2, args=(str(tmp_path / "run"),),
                       timeout=90)
    assert out == ("building the engine", 1)
