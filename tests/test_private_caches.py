"""Tests share no cache between runs (tests/conftest.py ``private_caches``).

A run stopped while torch.compile wrote a kernel leaves a truncated ``.so`` in inductor's
default cache folder, which every run and every rank on the machine shares; the next run
loaded it and failed ("main.so: file too short"). Here such a folder is made on purpose
(``TMPDIR`` points the default at this test's folder, so nothing outside it is touched): a
compile without the suite's cache settings fails on it, and one started by a test with them
compiles afresh in the test's own folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PRIVATE_CACHES

COMPILE = """
import torch
x = torch.arange(8.0)
torch.testing.assert_close(torch.compile(lambda t: (t * 3).sin())(x), (x * 3).sin())
"""


def _compile(*envs: dict[str, str]) -> list[subprocess.CompletedProcess]:
    """The compile in one process per environment, run side by side."""
    procs = [subprocess.Popen([sys.executable, "-c", COMPILE], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for env in envs]
    outputs = [p.communicate(timeout=540) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *out)
            for p, out in zip(procs, outputs, strict=True)]


@pytest.mark.slow
@pytest.mark.long
def test_a_truncated_kernel_in_the_default_cache_is_not_loaded(tmp_path):
    """~40 CPU-s: two cold compiles and one that fails (that one beside the second)."""
    private = dict(os.environ)  # what this test and every process it starts see
    private |= {"TMPDIR": str(tmp_path / "tmp"), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    (tmp_path / "tmp").mkdir()
    shared = {k: v for k, v in private.items()  # inductor's defaults: precompiled headers on
              if k not in PRIVATE_CACHES and k != "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"}
    (first,) = _compile(shared)
    assert first.returncode == 0, first.stderr[-3000:]
    (default,) = (tmp_path / "tmp").glob("torchinductor_*")
    built = [*default.rglob("*.so"), *default.rglob("*.gch")]
    assert any(p.name.endswith(".main.so") for p in built), built
    for path in built:  # what a compile stopped mid-write leaves
        path.write_bytes(path.read_bytes()[:64])

    broken, fresh = _compile(shared, private)
    assert broken.returncode != 0, "the truncated kernels were not loaded: the check is void"
    assert str(default) in broken.stderr, broken.stderr[-3000:]  # it failed on a planted file
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    own = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert own.is_relative_to(tmp_path) and list(own.rglob("*.so"))


def test_every_cache_folder_is_the_tests_own(tmp_path):
    for variable in PRIVATE_CACHES:
        assert Path(os.environ[variable]).is_relative_to(tmp_path / "caches"), variable
    assert os.environ["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "0"


def _cache_settings(rank: int, world: int) -> dict[str, str]:
    return {variable: os.environ[variable] for variable in PRIVATE_CACHES}


def test_ranks_forked_for_a_test_get_its_cache_folders(tmp_path, monkeypatch):
    """tests/spawn.py forks ranks from a server started by an earlier test: each rank must
    see the calling test's folders, not the environment the server started with (here the
    server starts, if no earlier test in this process started it, before the folders move)."""
    from spawn import run_ranks

    run_ranks(_cache_settings, 1)
    for variable in PRIVATE_CACHES:
        monkeypatch.setenv(variable, str(tmp_path / "moved" / variable))
    for settings in run_ranks(_cache_settings, 2):
        assert settings == {variable: str(tmp_path / "moved" / variable)
                            for variable in PRIVATE_CACHES}
