"""Training from a URL: 2 torchrun ranks from an S3 server and one rank from an HTTP server
(both on loopback, tools/remote_servers.py), each resumed from its checkpoint inside an epoch
and a shard, ending with the weights of the unbroken run; the HTTP run's also equal those of
a run on the same shards in a local folder, which reads each sample once per epoch
(tests/data_pipeline/test_data_loader.py; the S3 loader's epochs equal the local ones in
tests/data_pipeline/test_remote_data.py), as do one rank's from a GCS emulator. A URL the
server denies or lacks is refused by ``--check`` and by the run in one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from launch_helpers import ROOT
from shard_helpers import make_shards

from tools.remote_servers import FileServer, GcsServer, S3Server, upload

COMMON = ["--config", str(ROOT / "configs" / "smoke.yaml"), "engine.type=ddp",
          "train.batch_size=8", "log.every=1", "log.progress=false", "log.wandb=disabled",
          "checkpoint.every=3", "data.num_workers=1"]


def _torchrun(data: str, run, steps: int, env: dict, *more: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "launch.train", *COMMON, f"data.dir={data}", f"output={run}",
           f"train.max_steps={steps}", *more]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout + done.stderr


def _step(run, step: int):
    return run / "checkpoints" / f"step-{step:08d}"


def _weights(run, step: int) -> dict:
    return torch.load(_step(run, step) / "backbone.pt", weights_only=True)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# make test-long: the loader's own tests (tests/data_pipeline/test_remote_data.py) resume two
# ranks mid-shard from S3 and fetch from a resume's byte offset over HTTP, and the GCS run
# below trains from a store; this one walks both through launch.train (50 CPU-s).
@pytest.mark.slow
@pytest.mark.long
def test_two_ranks_from_s3_and_one_from_http_resume_mid_shard_as_an_unbroken_local_run(
        tmp_path, capsys):
    from launch.train import main

    served = tmp_path / "served"
    local = make_shards(served / "set", [13, 5, 9, 1, 17, 8, 11])  # 4 steps of 2 x 8 an epoch
    s3 = S3Server()
    http = FileServer(served, deny=("/denied",))
    env = {**s3.environment(), "AWS_EC2_METADATA_DISABLED": "true"}
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            upload(local, "s3://bucket/set")
            # 2 ranks: 6 steps unbroken, then again from its checkpoint after 3 (inside an
            # epoch of 4 steps and inside a shard)
            _torchrun("s3://bucket/set", tmp_path / "s3", 6, env)
            out = _torchrun("s3://bucket/set", tmp_path / "s3-resumed", 6, env,
                            f"checkpoint.resume={_step(tmp_path / 's3', 3)}")
            assert "resumed from" in out and "test-secret-1234" not in out
            assert _same(_weights(tmp_path / "s3", 6), _weights(tmp_path / "s3-resumed", 6))
            assert "test-secret-1234" not in (tmp_path / "s3" / "config.yaml").read_text()
        # 1 rank in this process, from the HTTP server: as from the local folder, resumed too
        url = http.url + "/set"
        for data, run, more in [(local, "local", []), (url, "http", []),
                                (url, "http-resumed", [f"checkpoint.resume="
                                                       f"{_step(tmp_path / 'http', 3)}"])]:
            assert main([*COMMON, f"data.dir={data}", f"output={tmp_path / run}",
                         "train.max_steps=6", *more]) == 0
        for run in ("http", "http-resumed"):
            assert _same(_weights(tmp_path / "local", 6), _weights(tmp_path / run, 6))
        # a URL the server denies or does not have: one line and exit 2, --check as the run
        capsys.readouterr()
        for url, problem in [(http.url + "/none", "not found"), (http.url + "/denied", "denied")]:
            for check in (["--check"], []):
                assert main([*check, *COMMON, f"data.dir={url}",
                             f"output={tmp_path / 'refused'}"]) == 2
                said = capsys.readouterr()
                assert f"{url}/manifest.json: " in said.out + said.err
                assert problem in said.out + said.err
    finally:
        http.close()
        s3.close()



@pytest.mark.slow
def test_one_rank_from_gcs_trains_as_from_the_local_folder_showing_its_storage_wait(tmp_path):
    """gs:// through gcsfs, on the GCS emulator: the weights of a local run, each metrics
    record holding the share of the loader's time spent waiting on the store (and the
    retries), the step line showing it (``storage N%``); a local run shows neither."""
    import json

    from launch.train import main

    local = make_shards(tmp_path / "set", [13, 5, 9, 1, 17, 8, 11])
    gcs = GcsServer()
    try:
        url = gcs.upload(local, "set")
        cmd = [sys.executable, "-m", "launch.train", *COMMON, f"data.dir={url}",
               f"output={tmp_path / 'gcs'}", "train.max_steps=4"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, **gcs.environment(), "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        gcs.close()
    assert main([*COMMON, f"data.dir={local}", f"output={tmp_path / 'local'}",
                 "train.max_steps=4"]) == 0
    assert _same(_weights(tmp_path / "local", 4), _weights(tmp_path / "gcs", 4))
    for run, remote in [("gcs", True), ("local", False)]:
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").open()]
        lines = [line for line in (tmp_path / run / "train.log").read_text().splitlines()
                 if " img/s " in line]
        assert len(rows) == len(lines) == 4
        if remote:
            assert all(0 <= r["storage_wait_share"] <= 1 and r["storage_retries"] == 0
                       for r in rows)
            assert all(f"storage {100 * r['storage_wait_share']:.0f}% ETA" in line
                       for r, line in zip(rows, lines, strict=True))
        else:
            assert not any("storage" in key for r in rows for key in r)
            assert not any("storage" in line for line in lines)
