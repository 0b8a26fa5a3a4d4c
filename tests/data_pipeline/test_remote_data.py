"""Shards at a URL: the loader against real servers on loopback (tools/remote_servers.py), an
HTTP file server with Range support and moto's S3 server, with faults from a TCP proxy between.
What the local loader promises must hold: the same batches, each sample once per epoch, an
exact resume; transient faults cost retries, never a sample; permanent ones one line."""

import shutil

import pytest
import torch
from shard_helpers import epoch_keys, make_shards

from data_pipeline import make_loader
from data_pipeline.errors import ShardError
from data_pipeline.remote import Retry, StorageError, open_folder, permanent_failure, scrub
from data_pipeline.remote_shards import Streaming
from data_pipeline.shard_index import read_index
from tools.remote_servers import FaultProxy, FileServer, clear_clients, upload

UNEVEN = [13, 5, 9, 1, 17, 8, 11]  # 64 samples
FAST = Streaming(retry=Retry(attempts=6, first_delay_s=0.01, max_delay_s=0.05, timeout_s=0.5))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    make_shards(root / "set", UNEVEN)
    return root


@pytest.fixture(scope="module")
def http(root):
    server = FileServer(root, deny=("/denied",))
    yield server
    server.close()


@pytest.fixture(scope="module")
def s3(root, s3_store):
    upload(root / "set", "s3://bucket/set")
    return s3_store


def batches(loader):
    return [tuple(part.clone() if torch.is_tensor(part) else part for part in batch)
            for batch in loader]


def same(a, b):
    return len(a) == len(b) and all(
        x[-1] == y[-1] and all(torch.equal(p, q) for p, q in zip(x[:-1], y[:-1], strict=True))
        for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("source", ["http", "s3"])
def test_an_epoch_read_from_a_url_is_the_local_epoch(root, request, source, workers):
    url = (request.getfixturevalue("http").url + "/set" if source == "http" else
           (request.getfixturevalue("s3"), "s3://bucket/set")[1])
    kwargs = dict(batch_size=4, num_workers=workers, seed=3, with_keys=True, shuffle_buffer=5,
                  world_size=2)
    for rank in range(2):
        local = batches(make_loader(root / "set", rank=rank, **kwargs))
        remote = batches(make_loader(url, rank=rank, streaming=FAST, **kwargs))
        assert same(local, remote) and len(remote) == 8


def test_a_file_url_is_the_local_folder(root):
    assert open_folder(f"file://{root}/set/") == root / "set"
    keys = epoch_keys(make_loader(f"file://{root}/set", batch_size=4, num_workers=0,
                                  with_keys=True))
    assert sorted(keys) == sorted(f"{i:09d}" for i in range(64))


def test_two_ranks_from_s3_read_each_sample_once_and_resume_mid_shard_exactly(root, s3):
    kwargs = dict(batch_size=3, world_size=2, num_workers=1, seed=5, shuffle_buffer=6,
                  with_keys=True, streaming=FAST)
    keys = []
    for rank in range(2):
        full = batches(make_loader("s3://bucket/set", rank=rank, **kwargs))
        first = make_loader("s3://bucket/set", rank=rank, **kwargs)
        head = []
        for step, batch in enumerate(first):
            head.append(batch)
            if step == 4:
                break
        resumed = make_loader("s3://bucket/set", rank=rank, **kwargs)
        resumed.load_state_dict(first.state_dict())
        assert same(full, head + batches(resumed))  # one worker: the very same batches
        keys += [k for batch in full for k in batch[-1]]
    assert len(keys) == len(set(keys)) == 2 * 10 * 3


def test_a_resume_fetches_from_the_byte_offset_of_its_first_sample_left(root, http):
    kwargs = dict(batch_size=3, num_workers=1, shuffle=False, with_keys=True, streaming=FAST)
    url = http.url + "/set"
    full = batches(make_loader(url, **kwargs))
    first = make_loader(url, **kwargs)
    head = [batch for _, batch in zip(range(2), first, strict=False)]  # 6 of shard 0's 13
    resumed = make_loader(url, **kwargs)
    resumed.load_state_dict(first.state_dict())
    del http.requests[:]
    assert same(full, head + batches(resumed))
    offset = int(read_index(root / "set" / "shard-000000.tar").members[6, 0]) - 512
    assert http.gets("shard-000000.tar")[0].startswith(f"bytes={offset}-")


def test_cut_connections_503_bursts_and_stalls_are_retried_losing_nothing(root, http, capfd):
    host, port = http.url.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port)))
    try:
        kwargs = dict(batch_size=4, num_workers=1, with_keys=True)
        local = batches(make_loader(root / "set", **kwargs))
        loader = make_loader(proxy.url + "/set", **kwargs,
                             streaming=Streaming(block_mib=8 / 1024, retry=FAST.retry))
        proxy.inject([("cut", 5000), ("503",), ("503",), ("503",), ("delay", 2.0),
                      ("cut", 20000)])
        assert same(local, batches(loader)) and not proxy.faults
        assert loader.storage.retries >= 5 and 0 < loader.storage.wait_s < loader.storage.stream_s
        log = capfd.readouterr().err  # the worker's lines
        assert "503" in log and "retry" in log and "Timeout" in log
    finally:
        proxy.close()


def test_faults_between_s3_and_two_workers_lose_and_double_nothing(root, s3):
    host, port = s3.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port)))
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("AWS_ENDPOINT_URL", proxy.url)
            clear_clients()
            kwargs = dict(batch_size=4, num_workers=2, with_keys=True, seed=1)
            local = batches(make_loader(root / "set", **kwargs))
            loader = make_loader("s3://bucket/set", streaming=FAST, **kwargs)
            proxy.inject([("cut", 3000), ("503",), ("503",), ("cut", 9000)] * 2)
            assert same(local, batches(loader)) and not proxy.faults
        clear_clients()
    finally:
        proxy.close()


def test_permanent_errors_are_one_line_naming_the_url_without_credentials(http, s3):
    with pytest.raises(StorageError, match=r"^http://127\.0\.0\.1:\d+/missing/manifest\.json: "
                       r"not found \(404"):
        make_loader(http.url + "/missing", batch_size=2)
    with pytest.raises(StorageError, match=r"/denied/manifest\.json: access denied \(401/403\)"):
        make_loader(http.url + "/denied", batch_size=2)
    with pytest.raises(StorageError, match=r"^s3://no-such-bucket/set/manifest\.json: not found"):
        make_loader("s3://no-such-bucket/set", batch_size=2)
    with pytest.raises(StorageError, match=r"^http://\*\*\*@127.* credentials in a data URL"):
        make_loader(http.url.replace("//", "//user:secret@") + "/set", batch_size=2)
    with pytest.MonkeyPatch.context() as env:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.delenv(name)
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        env.setenv("AWS_CONFIG_FILE", "/nonexistent")
        clear_clients()
        with pytest.raises(StorageError, match=r"^s3://bucket/set/manifest\.json: no credentials"):
            make_loader("s3://bucket/set", batch_size=2)
    clear_clients()
    assert scrub("key test-secret-1234 at https://a:b@host/x") == "key *** at https://***@host/x"


def test_gcsfs_errors_are_classified_as_its_messages_and_codes_say():
    """gcsfs (its emulator has no access rules to test against) reports a 403 as an OSError
    saying "Forbidden" over two lines and other statuses as an error with ``code``."""
    from gcsfs.retry import HttpError

    assert permanent_failure(OSError("Forbidden: bucket/set\nno access")).startswith(
        "access denied")
    assert permanent_failure(HttpError({"code": 401, "message": "Invalid"})).startswith(
        "access denied")
    assert permanent_failure(HttpError({"code": 503, "message": "busy"})) is None
    assert permanent_failure(OSError("connection reset")) is None


def test_a_missing_or_rewritten_remote_shard_stops_the_loader_before_training(root, tmp_path):
    served = tmp_path / "served"
    shutil.copytree(root / "set", served / "set")
    server = FileServer(tmp_path / "served")
    try:
        shard = served / "set" / "shard-000003.tar"
        shard.write_bytes(shard.read_bytes()[:-512])
        with pytest.raises(ShardError, match=r"/set/shard-000003\.tar: \d+ bytes stored, "
                           "manifest says"):
            make_loader(server.url + "/set", batch_size=2)
        shard.unlink()
        with pytest.raises(ShardError, match=r"/set/shard-000003\.tar: shard listed in the "
                           "manifest is missing"):
            make_loader(server.url + "/set", batch_size=2)
    finally:
        server.close()


def test_ranks_sharing_a_cache_fetch_each_shard_once_and_later_epochs_read_it(root, tmp_path):
    server = FileServer(root)
    try:
        cache = Streaming(cache_dir=str(tmp_path / "cache"), retry=FAST.retry)
        kwargs = dict(batch_size=4, world_size=2, num_workers=2, with_keys=True, seed=2,
                      streaming=cache)
        loaders = [make_loader(server.url + "/set", rank=r, **kwargs) for r in range(2)]
        for epoch in range(2):
            keys = []
            for loader in loaders:
                loader.set_epoch(epoch)
                keys += epoch_keys(loader)
            assert len(keys) == len(set(keys)) == 64
        for shard in sorted((root / "set").glob("*.tar")):  # one whole-shard GET each
            assert server.gets(shard.name) == [f"bytes=0-{shard.stat().st_size - 1}"]
            assert len(server.gets(shard.name + ".idx")) == 1
        tiny = Streaming(cache_dir=str(tmp_path / "tiny"), cache_gib=40_000 / 2**30,
                         retry=FAST.retry)
        loader = make_loader(server.url + "/set", batch_size=4, num_workers=0, with_keys=True,
                             streaming=tiny)
        assert len(epoch_keys(loader)) == 64
        kept = sum(p.stat().st_size for p in loader.reader.cache.dir.glob("*.tar*"))
        assert kept <= 40_000 + max(p.stat().st_size for p in (root / "set").glob("*.tar"))
    finally:
        server.close()
