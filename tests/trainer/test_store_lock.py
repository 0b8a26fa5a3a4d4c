"""The run lock of a folder in an object store: a lease object created with a conditional
write, on moto's S3 server on loopback (conftest ``s3_store``); and a missing store client
refused in one line naming the extra that installs it."""

from __future__ import annotations

import json
import sys
import time

import pytest

from trainer.run_lock import STALE_S, Lease, RunFolderInUse
from trainer.stopping import StopReason, StopRequests


def _store(name: str):
    from data_pipeline.store import open_store

    return open_store(f"s3://bucket/{name}")


def _plant(store, lease: Lease) -> None:
    store.put(".lock", json.dumps(lease.__dict__).encode())


def test_a_live_lease_refuses_a_dead_one_is_taken_over_and_release_deletes_it(s3_store):
    from trainer.store_lock import StoreLock

    store = _store("lease")
    holder = StoreLock(store, host="node-a")
    assert holder.acquire() is None
    try:
        with pytest.raises(RunFolderInUse) as err:
            StoreLock(store, host="node-b").acquire()
        assert str(err.value).startswith("s3://bucket/lease is in use by another job (pid ")
        assert StoreLock(store, host="node-b").probe() == str(err.value)
    finally:
        holder.release()
    assert store.get(".lock") is None  # a clean end deletes the lease
    now = time.time()
    _plant(store, Lease("node-a", 1, now - 600, now - STALE_S - 1))  # unrenewed: a dead job
    taker = StoreLock(store, host="node-b")
    line = taker.acquire()
    try:
        assert line is not None and line.startswith("run lock: took over s3://bucket/lease/.lock "
                                                     "from pid 1 on node-a")
        assert Lease(**json.loads(store.get(".lock"))).host == "node-b"
    finally:
        taker.release()


def test_a_job_whose_lease_was_taken_over_asks_to_stop(s3_store):
    from trainer.store_lock import StoreLock

    store = _store("taken")
    stops = StopRequests()
    lock = StoreLock(store, host="node-a", stops=stops)
    lock.acquire()
    try:
        assert lock.beat()  # renewed: still ours
        now = time.time()
        _plant(store, Lease("node-b", 7, now, now))  # another job took it while this one hung
        assert not lock.beat()
        assert stops.reason is StopReason.LOCK_LOST
    finally:
        lock.release()
    assert Lease(**json.loads(store.get(".lock"))).host == "node-b"  # not ours to delete


@pytest.mark.parametrize(("scheme", "module", "extra"), [
    ("s3", "s3fs", "s3"), ("gs", "gcsfs", "gcs"), ("az", "adlfs", "azure")])
def test_a_missing_store_client_is_one_line_naming_its_extra(scheme, module, extra, monkeypatch):
    import importlib

    from data_pipeline.store import StorageError, open_store

    registry = importlib.import_module("fsspec.registry")  # (fsspec.registry: its mapping)
    monkeypatch.delitem(registry._registry, scheme, raising=False)  # not imported yet
    monkeypatch.setitem(sys.modules, module, None)  # and not installed
    with pytest.raises(StorageError) as err:
        open_store(f"{scheme}://bucket/runs/a")
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"{scheme}://bucket/runs/a: ")
    assert str(err.value).endswith(f"(pip install 'partial-fc[{extra}]')")
