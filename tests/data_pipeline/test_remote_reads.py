"""RemoteFolder.read against a link that cuts every connection after N bytes (a TCP proxy,
tools/remote_servers.FaultProxy, in front of a real HTTP server on loopback): a range much
longer than N arrives whole, in pieces, each cut costing only the piece in flight; the retry
budget counts tries that brought nothing, so a read needing many more retries than the budget
still completes, and a link that passes nothing fails after exactly the budget."""

import re

import pytest

from data_pipeline.remote import MIN_PIECE, RemoteFolder, Retry, StorageError
from tools.remote_servers import FaultProxy, FileServer

SIZE = 300_000  # a shard's worth: many times the cut and the pieces
QUICK = dict(first_delay_s=0.01, max_delay_s=0.02, timeout_s=5.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    (root / "blob").write_bytes(bytes(range(256)) * (SIZE // 256) + b"x" * (SIZE % 256))
    served = FileServer(root)
    yield served, (root / "blob").read_bytes()
    served.close()


def _through(server, cut_after: int):
    host, port = server.url.removeprefix("http://").split(":")
    return FaultProxy((host, int(port)), cut_after=cut_after)


def _pieces(server) -> list[tuple[int, int]]:
    """The byte ranges the server was asked for, in order (HTTP Range: inclusive end)."""
    return [(int(a), int(b) + 1) for a, b in (re.fullmatch(r"bytes=(\d+)-(\d+)", r).groups()
                                             for r in server.gets("blob"))]


def test_a_range_longer_than_every_connection_arrives_whole_losing_only_pieces(server, capfd):
    served, blob = server
    proxy = _through(served, cut_after=40_000)
    try:
        folder = RemoteFolder(proxy.url, Retry(attempts=3, piece_bytes=128 << 10, **QUICK))
        del served.requests[:]
        assert folder.read("blob", 1000, SIZE - 1000) == blob[1000:SIZE - 1000]
        # 128 KiB pieces never pass a 40 kB link: halved, with one line each, to 32 KiB
        lines = capfd.readouterr().err.splitlines()
        assert [line.rsplit("pieces of ", 1)[1] for line in lines] == ["64 KiB", "32 KiB"]
        asked = _pieces(served)
        assert [hi - lo for lo, hi in asked[:3]] == [128 << 10, 64 << 10, 32 << 10]
        # from then on each range starts where the last received one ended: a cut loses
        # the piece in flight (asked again), never what arrived before it
        after = asked[2:]
        assert all(lo in (prev_lo, prev_hi) for (prev_lo, prev_hi), (lo, _) in
                   zip(after, after[1:], strict=False))
        resent = sum(hi - lo for lo, hi in after) - (SIZE - 2000)
        assert 0 < resent <= proxy.cuts * (32 << 10)
        # far more retries than the budget of 3: each try after the halving brought a piece
        stats = folder.stats
        assert stats.retries == proxy.cuts >= 8 and stats.bytes == SIZE - 2000
        assert stats.requests == len(asked) - stats.retries
        # the folder keeps the piece that passed: its next read starts from it
        assert folder.piece == 32 << 10 and folder.read("blob", 0, 100_000) == blob[:100_000]
        assert _pieces(served)[len(asked)] == (0, 32 << 10)
    finally:
        proxy.close()


def test_a_read_that_met_no_failure_doubles_the_piece_back(server):
    served, blob = server
    folder = RemoteFolder(served.url, Retry(piece_bytes=128 << 10, **QUICK))
    folder.piece = 32 << 10  # as a link that cut left it
    pieces = []
    for _ in range(3):
        assert folder.read("blob", 0, 200_000) == blob[:200_000]
        pieces.append(folder.piece)
    assert pieces == [64 << 10, 128 << 10, 128 << 10]
    folder.read("blob", 0, 1000)  # too short to show a whole piece passes: no change
    assert folder.piece == 128 << 10


def test_a_whole_file_longer_than_a_piece_is_read_to_its_size(server):
    served, blob = server
    proxy = _through(served, cut_after=50_000)
    try:
        folder = RemoteFolder(proxy.url, Retry(attempts=3, piece_bytes=MIN_PIECE, **QUICK))
        assert folder.read("blob") == blob and proxy.cuts > 0
        assert folder.read("blob", SIZE - 10) == blob[-10:]
    finally:
        proxy.close()


def test_a_link_that_passes_nothing_fails_after_the_budget_in_one_line(server, capfd):
    served, _ = server
    proxy = _through(served, cut_after=100)  # not even the response's headers
    try:
        folder = RemoteFolder(proxy.url, Retry(attempts=4, **QUICK))
        with pytest.raises(StorageError, match=r"^http://127\.0\.0\.1:\d+/blob: bytes 0-5000: "
                           r"4 tries in a row brought nothing \(.*\); check the network"):
            folder.read("blob", 0, 5000)
        lines = capfd.readouterr().err.splitlines()
        assert len(lines) == folder.stats.retries == 3 and "pieces of" not in lines[-1]
    finally:
        proxy.close()


def test_a_server_that_ignores_ranges_is_refused_in_one_line(server):
    """Python's own ``http.server`` answers a range request with the whole file."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0),
                                functools.partial(Quiet, directory=str(server[0].root)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        folder = RemoteFolder(f"http://127.0.0.1:{httpd.server_port}", Retry(**QUICK))
        with pytest.raises(StorageError, match=r"/blob: asked for bytes 0-1000, got 300000 "
                           r"bytes \(a server that ignores Range requests cannot serve shards"):
            folder.read("blob", 0, 1000)
    finally:
        httpd.shutdown()
        httpd.server_close()
