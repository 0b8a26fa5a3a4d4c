"""Real servers on loopback for the remote-data tests and bench/loader.py: a plain HTTP file
server with Range support, moto's S3 server, a GCS emulator, Azurite (Azure Blob), and a TCP
proxy in front of one that adds latency or injects faults. Nothing here mocks a client
library: the loader's fsspec clients talk to these over sockets. Loopback only (127.0.0.1)."""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class FileServer:
    """Serves the files under ``root`` over HTTP/1.1 on 127.0.0.1 with byte ranges; paths
    under ``deny`` get 403. ``requests`` logs ``(method, path, range header)``."""

    def __init__(self, root: Path, deny: tuple[str, ...] = ()):
        self.root, self.deny, self.requests = Path(root), deny, []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                self.reply(head=True)

            def do_GET(self):
                self.reply(head=False)

            def reply(self, head: bool):
                server.requests.append((self.command, self.path, self.headers.get("Range")))
                path = server.root / self.path.lstrip("/")
                if any(self.path.startswith(d) for d in server.deny):
                    return self.empty(403)
                if not path.is_file():
                    return self.empty(404)
                data = path.read_bytes()
                start, end, status = 0, len(data), 200
                wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                if wanted:
                    start = int(wanted[1])
                    end = min(len(data), int(wanted[2]) + 1) if wanted[2] else len(data)
                    status = 206
                self.send_response(status)
                self.send_header("Content-Length", str(end - start))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                self.end_headers()
                if not head:
                    self.wfile.write(data[start:end])

            def empty(self, status: int):
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def gets(self, name: str) -> list[str | None]:
        """The Range headers of the GETs of files whose path ends with ``name``."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + name)]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class S3Server:
    """moto's S3 server on 127.0.0.1, and the client configuration that reaches it (as the
    standard AWS_* variables, what a user sets for MinIO or Ceph)."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def environment(self, endpoint: str | None = None) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": "test-key-id", "AWS_SECRET_ACCESS_KEY": "test-secret-1234",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint or self.endpoint}

    def make_bucket(self, name: str) -> None:
        """Create bucket ``name`` (boto3, told the endpoint and keys directly)."""
        import boto3

        env = self.environment()
        boto3.client("s3", endpoint_url=self.endpoint, region_name=env["AWS_DEFAULT_REGION"],
                     aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"]
                     ).create_bucket(Bucket=name)

    def close(self):
        self.server.stop()


class GcsServer:
    """The GCS emulator of ``gcp-storage-emulator`` on 127.0.0.1, in memory, with a bucket
    ``bucket``; :meth:`environment` is the configuration that points gcsfs at it: the
    emulator's standard variable, anonymous access (fsspec's configuration), and gcsfs's
    experimental gRPC bucket probe off (an emulator speaks JSON only; read when gcsfs is
    imported, so a process that reads the emulator is started with it)."""

    def __init__(self):
        from gcp_storage_emulator.server import create_server

        with socket.socket() as probe:  # the emulator takes a port, not 0
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.server = create_server("127.0.0.1", port, in_memory=True, default_bucket="bucket")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def environment(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "FSSPEC_GCS_TOKEN": "anon",
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def upload(self, folder: Path, prefix: str) -> str:
        """Copy the files of ``folder`` under ``prefix`` of the bucket through the storage
        JSON API (no client library in this process); returns the ``gs://`` URL."""
        import urllib.parse
        import urllib.request

        for path in sorted(folder.iterdir()):
            name = urllib.parse.quote(f"{prefix}/{path.name}", safe="")
            request = urllib.request.Request(
                f"{self.endpoint}/upload/storage/v1/b/bucket/o?uploadType=media&name={name}",
                data=path.read_bytes(), method="POST")
            urllib.request.urlopen(request).close()
        return f"gs://bucket/{prefix}"

    def close(self):
        self.server.stop()


AZURITE = Path(__file__).resolve().parent / "azurite" / "node_modules" / ".bin" / "azurite-blob"
AZURITE_INSTALL = ("make setup installs Azurite (tools/azurite/package.json) where npm is on the "
                   "machine: cd tools/azurite && npm ci")


class AzureServer:
    """Azurite's Blob service (the version tools/azurite/package.json pins, installed there
    by ``make setup``) on 127.0.0.1, in memory, with a container ``container``;
    :meth:`environment` is the configuration that points adlfs at it: the standard connection
    string variable, with Azurite's published development account and key. Raises
    FileNotFoundError (:data:`AZURITE_INSTALL`) when Azurite is not installed."""

    ACCOUNT = "devstoreaccount1"
    KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
           "KBHBeksoGMGw==")

    def __init__(self, workdir: Path):
        import subprocess

        if not AZURITE.exists():
            raise FileNotFoundError(f"{AZURITE}: {AZURITE_INSTALL}")
        self.process = subprocess.Popen(
            [str(AZURITE), "--inMemoryPersistence", "--extentMemoryLimit", "256", "--blobHost",
             "127.0.0.1", "--blobPort", "0", "--skipApiVersionCheck", "--loose", "--silent"],
            cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in self.process.stdout:  # "... successfully listens on http://127.0.0.1:N"
            found = re.search(r"listens on (http://\S+)", line)
            if found:
                self.endpoint = found[1]
                break
        else:
            raise RuntimeError(f"Azurite ended with {self.process.wait()} before listening")
        threading.Thread(target=self.process.stdout.read, daemon=True).start()  # drained
        from azure.storage.blob import BlobServiceClient

        BlobServiceClient.from_connection_string(self.connection_string()).create_container(
            "container")

    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={self.ACCOUNT};AccountKey={self.KEY};"
                f"BlobEndpoint={self.endpoint}/{self.ACCOUNT};")

    def environment(self) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string()}

    def close(self):
        """Stop it: SIGTERM, then SIGKILL after 5 s (Azurite waits for its clients' idle
        keep-alive connections to close; it holds nothing on disk)."""
        import subprocess

        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def upload(folder: Path, url: str) -> str:
    """Copy the files of ``folder`` to the (S3) ``url`` through fsspec; returns ``url``."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    with contextlib.suppress(FileExistsError):
        fs.mkdir(root.split("/", 1)[0])
    for path in sorted(folder.iterdir()):
        fs.pipe_file(f"{url}/{path.name}", path.read_bytes())
    return url


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream`` (host, port). Each new connection
    takes the next fault of ``faults`` (none once they run out): ``("503",)`` answers its
    first request with a 503 and closes; ``("cut", n)`` closes it after ``n`` bytes of
    response; ``("delay", s)`` holds the response ``s`` seconds. ``latency_s`` delays every
    request (each read from a client) that long: a round trip to a distant store.
    ``cut_after``: every connection without a fault of its own is closed after that many
    bytes of response (headers included), a link that kills long transfers."""

    def __init__(self, upstream: tuple[str, int], faults=(), latency_s: float = 0.0,
                 cut_after: int | None = None):
        self.upstream, self.faults, self.latency_s = upstream, deque(faults), latency_s
        self.cut_after, self.cuts = cut_after, 0  # cuts: connections closed mid-transfer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.closed, self.open = False, set()
        threading.Thread(target=self._accept, daemon=True).start()

    def inject(self, faults):
        """Queue ``faults`` for the next connections and end the open ones (a client's
        keep-alive connections would otherwise never meet them)."""
        self.faults.extend(faults)
        for client in list(self.open):
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)

    def _accept(self):
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            fault = self.faults.popleft() if self.faults else None
            threading.Thread(target=self._serve, args=(client, fault), daemon=True).start()

    def _serve(self, client: socket.socket, fault):
        self.open.add(client)
        with client:
            if fault and fault[0] == "503":
                client.recv(65536)
                client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                               b"Connection: close\r\n\r\n")
                return
            upstream = socket.create_connection(self.upstream)
            with upstream:
                threading.Thread(target=_pump, args=(client, upstream, None, 0,
                                                     self.latency_s), daemon=True).start()
                limit = fault[1] if fault and fault[0] == "cut" else (
                    None if fault else self.cut_after)
                delay = fault[1] if fault and fault[0] == "delay" else 0
                if _pump(upstream, client, limit, delay):
                    self.cuts += 1
        self.open.discard(client)

    def close(self):
        self.closed = True
        with contextlib.suppress(OSError):  # wakes the thread blocked in accept (close does not)
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()


def _pump(source: socket.socket, sink: socket.socket, limit: int | None, delay: float,
          every: float = 0.0) -> bool:
    """Copy ``source`` to ``sink`` until either closes, or ``limit`` bytes have passed (then
    both are shut), holding the first bytes back ``delay`` seconds and every read ``every``.
    True when it cut the connection at ``limit``."""
    sent, cut = 0, False
    try:
        while True:
            data = source.recv(65536)
            if not data:
                break
            if delay or every:
                time.sleep(delay or every)
                delay = 0
            if limit is not None and sent + len(data) >= limit:
                sink.sendall(data[:limit - sent])
                cut = True
                break
            sink.sendall(data)
            sent += len(data)
    except OSError:
        pass
    for s in (source, sink):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
    return cut


def clear_clients():
    """Forget fsspec's cached S3 clients (each holds the endpoint it was made with)."""
    with contextlib.suppress(ImportError):
        from s3fs import S3FileSystem

        S3FileSystem.clear_instance_cache()
