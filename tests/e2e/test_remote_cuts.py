"""A 2-rank run reading its shards from S3 (moto's server on loopback) through a link that
cuts every connection after 100 kB, a sixth of a shard: the run completes with the losses
of the same run on the local folder. Each read keeps what arrived before a cut
(data_pipeline.remote), so the link costs retries, never the run. The ranks are forked
(tests/spawn.py) and train both runs in one process group, the local one first."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from spawn import run_ranks

from tools.remote_servers import FaultProxy, clear_clients, upload

CUT_AFTER = 100_000  # bytes a connection carries before the link cuts it


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """20 classes x 8 images in 2 shards of about 650 kB."""
    from data_pipeline import write_synthetic_dataset

    root = tmp_path_factory.mktemp("cut-data")
    write_synthetic_dataset(root, num_classes=20, images_per_class=8, seed=0,
                            samples_per_shard=80)
    return root


def _two_runs(rank: int, world: int, local: str, url: str, out: str) -> None:
    from launch_helpers import ROOT

    from trainer.config import load_config
    from trainer.dist import attach
    from trainer.loop import train

    for data, run in ((local, "local"), (url, "s3")):
        cfg = load_config(ROOT / "configs" / "smoke.yaml", [
            f"data.dir={data}", f"output={out}/{run}", "engine.type=ddp",
            "train.batch_size=8", "train.max_steps=3", "log.every=1", "log.progress=false",
            "log.wandb=disabled", "log.hist_every=0", "checkpoint.every=0",
            "schedule.warmup_epochs=0",
            "data.num_workers=1"])
        train(cfg, attach(torch.device("cpu"), rank))


def _losses(run) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    return [r["loss"] for r in rows if "loss" in r]


# make test-long: the loader's reads through cut connections, 503 bursts and stalls are make
# test's (tests/data_pipeline/test_remote_data.py); this trains two ranks through them (27 s).
@pytest.mark.slow
@pytest.mark.long
def test_two_ranks_train_through_a_link_that_cuts_every_connection(shards, s3_store, tmp_path,
                                                                    monkeypatch):
    assert min(p.stat().st_size for p in shards.glob("*.tar")) > 4 * CUT_AFTER
    upload(shards, "s3://bucket/cut")
    host, port = s3_store.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port)), cut_after=CUT_AFTER)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        clear_clients()
        run_ranks(_two_runs, 2, args=(str(shards), "s3://bucket/cut", str(tmp_path)),
                  timeout=240)
    finally:
        proxy.close()
        clear_clients()
        # what the cut responses left of moto's server (in this process) for the collector:
        # collected now, not in a DataLoader worker a later test forks from this process,
        # where the reads from moto then timed out (seen with test_remote_data.py after this)
        gc.collect()
    local, remote = _losses(tmp_path / "local"), _losses(tmp_path / "s3")
    assert len(local) == 3 and remote == local
    assert proxy.cuts >= 2 * 4  # each shard's read, on each rank, cut again and again
    rows = [json.loads(line) for line in (tmp_path / "s3" / "metrics.jsonl").open()]
    assert rows[-1]["storage_retries"] > 0  # counted and reported
