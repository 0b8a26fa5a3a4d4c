"""A checkpoint into a store that fails half-way: moto's S3 server on loopback behind a proxy
that starts refusing every request once this rank's first part is staged (tools/remote_servers.py,
no client mocked). The save ends with one line saying the last complete checkpoint stays, and
it does: ``latest`` still names it, it verifies, and the cut-off one, with no meta.json, is
never taken."""

from __future__ import annotations

import pytest
from launch_helpers import build_engine, local_micro_batches, make_config

from tools.remote_servers import FaultProxy, clear_clients


def test_a_store_failing_mid_save_keeps_the_last_complete_checkpoint(
        tmp_path, one_rank_group, s3_store, monkeypatch):
    from data_pipeline.remote import Retry
    from data_pipeline.store import StoreFolder
    from trainer import checkpoint, seams
    from trainer.checkpoint import in_store

    host, port = s3_store.server.get_host_and_port()
    proxy = FaultProxy((host, port))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries: none (ours: 1 try)
    clear_clients()
    engine = build_engine(make_config("engine.type=ddp", "train.batch_size=4"))
    engine.step(0, local_micro_batches(0, 4, 0, 1, 1))
    store = StoreFolder("s3://bucket/failing", Retry(attempts=1))
    record = checkpoint.RunRecord(loader={"pos": 1})
    try:
        checkpoint.save(tmp_path, 1, engine, record, keep=3, store=store)

        def store_goes_down(path, step, rank):  # the rank's state is staged; uploads follow
            if step == 2 and path.name == "backbone.pt":
                proxy.inject([("503",)] * 10_000)

        seams.CHECKPOINT_WRITE.hooks = (store_goes_down,)
        with pytest.raises(checkpoint.CheckpointError) as failed:
            checkpoint.save(tmp_path, 2, engine, record, keep=3, store=store)
        seams.CHECKPOINT_WRITE.hooks = ()
        line = str(failed.value)
        assert "\n" not in line and line.startswith(
            "saving step 2 into s3://bucket/failing/checkpoints failed on rank 0: ")
        assert line.endswith("; the last complete checkpoint stays")
        proxy.faults.clear()
        assert store.get("checkpoints/latest") == b"step-00000001\n"
        found = in_store.fetch_verified(store, tmp_path / "copy")
        assert found is not None and found.name == "step-00000001"
    finally:
        seams.CHECKPOINT_WRITE.hooks = ()
        proxy.close()
        clear_clients()
