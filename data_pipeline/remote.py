"""Data folders at a URL: one client layer, fsspec, for every object store and web server.

``data.dir`` may be ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``https://host/path``,
``file:///path`` or a local path. :func:`open_folder` gives a :class:`~pathlib.Path` for a
local path or a ``file://`` URL (the loader memory-maps those, as always) and a
:class:`RemoteFolder` for anything else fsspec reads. Nothing here branches on the scheme: an
object store's endpoint and credentials come from its client's standard places (``AWS_*``
variables and profiles, ``AWS_ENDPOINT_URL`` for MinIO or Ceph,
``GOOGLE_APPLICATION_CREDENTIALS``, fsspec's configuration), never through this project, which
never prints them (:func:`scrub`) and refuses a URL that carries them.

Writing (``launch.convert`` into a URL, data_pipeline.output) uploads whole files, each
visible only once complete; a web server is read-only.

A read (a whole small file, the manifest or a member index, or one byte range of a shard) is
made of pieces of at most :attr:`Retry.piece_bytes`, each its own range request, one after the
other: a connection cut mid-transfer loses the piece in flight, never what arrived before it
(fsspec's ``cat_file`` keeps nothing of a body aiohttp reports cut short). Pieces rather than
one streamed body, because a range request is what every fsspec client offers alike; a
streamed body would be a call per client. Transient failures (a reset or cut connection, a
5xx, a timeout) are retried from the first byte not yet received. A try that brought a piece
is retried at once and costs nothing of the budget; a try that brought nothing is one of
:attr:`Retry.attempts`, halves the piece (of what the read still wants, down to
:data:`MIN_PIECE`: a link that kills every transfer after N bytes still passes pieces shorter
than that) and is followed by an exponential backoff. The folder keeps the halved piece for
its next reads in this process (they start from the piece that passed, not from the one a link
cuts) and doubles it back, up to :attr:`Retry.piece_bytes`, after each read that passed a
whole piece and met no failure. Every retry is counted (:attr:`RemoteFolder.stats`); a try
that brought nothing is also logged as one line on stderr (a cut after progress is not: a link
that cuts every connection would print one a piece). Permanent failures (403, 404, a missing
bucket, missing credentials) raise :class:`StorageError` at once: one line naming the URL and
the fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

from data_pipeline.errors import DataError

INSTALL = "pip install 'partial-fc[remote]' (fsspec with s3fs, gcsfs and aiohttp)"
MIN_PIECE = 16 << 10  # the smallest piece a read halves down to (bytes)
# the extra that installs each store's client (configuration, not a code path per scheme)
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure",
          "abfss": "azure"}
T = TypeVar("T")
_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")
# variables whose values a client library may echo in an error (never in ours)
_SECRET_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                     "GOOGLE_APPLICATION_CREDENTIALS")


class StorageError(DataError):
    """A data folder's URL cannot be read: denied, missing, or still failing after the
    retries. One line naming the URL (without credentials) and the fix."""


def scrub(text: object) -> str:
    """``text`` without credentials: a URL's ``user:password@`` and the values of the
    standard credential variables replaced by ``***``."""
    out = _USERINFO.sub("***@", str(text))
    for name in _SECRET_VARIABLES:
        value = os.environ.get(name, "")
        if len(value) >= 4:
            out = out.replace(value, "***")
    return out


def one_line(text: str) -> str:
    """``text`` on one line (a client's message may span several)."""
    return " ".join(text.split())


def is_url(location: str | os.PathLike) -> bool:
    return "://" in os.fspath(location)


def install_hint(url: str) -> str:
    """What installs the client of ``url``'s store: the extra named for its scheme
    (:data:`EXTRAS`), else the one with every client."""
    extra = EXTRAS.get(url.split("://", 1)[0].lower())
    return f"pip install 'partial-fc[{extra}]'" if extra else INSTALL


@dataclass(frozen=True)
class Retry:
    """Bounds of the retries of one read: ``attempts`` tries in a row that bring nothing
    (a try that brings a piece resets the count), waiting ``first_delay_s`` after the first
    and twice as long after each next one (at most ``max_delay_s``); one request, a piece of
    at most ``piece_bytes``, may take ``timeout_s``. 4 MiB, half the loader's 8 MiB requests:
    a request costs the S3 client about 5 ms of CPU (docs/data.md), which 1 MiB pieces would
    add to a worker's decoding 8 times a block; a link that cuts halves them as it needs."""

    attempts: int = 8
    first_delay_s: float = 0.1
    max_delay_s: float = 5.0
    timeout_s: float = 60.0
    piece_bytes: int = 4 << 20


@dataclass
class FetchStats:
    """What one process's reads of a folder cost: ``requests`` answered (a piece each) and
    their ``bytes``; ``retries``, requests made again after a failure (a cut after progress
    included) and ``retry_s``, the seconds slept before them; ``wait_s``, the seconds its
    loader stream waited for a read to finish."""

    requests: int = 0
    bytes: int = 0
    retries: int = 0
    retry_s: float = 0.0
    wait_s: float = 0.0


def open_folder(location: str | os.PathLike, retry: Retry | None = None) -> Path | RemoteFolder:
    """A data folder: a local :class:`Path`, or a :class:`RemoteFolder` for a URL fsspec reads
    remotely. StorageError for a URL with credentials in it, a scheme fsspec does not know, or
    one whose client is not installed."""
    text = os.fspath(location)
    if not is_url(text):
        return Path(text)
    if _USERINFO.search(text):
        raise StorageError(f"{scrub(text)}: credentials in a data URL would be written to "
                           "config.yaml and the logs; give them in the client's standard places "
                           "(AWS_* variables or profiles, GOOGLE_APPLICATION_CREDENTIALS, fsspec "
                           "config) instead")
    folder = RemoteFolder(text.rstrip("/"), retry or Retry())
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(folder.fs, LocalFileSystem):
        return Path(folder.path)
    return folder


class RemoteFolder:
    """A folder of files at ``url``, read through fsspec with :class:`Retry`'s retries
    (``path``: the URL as its client names it, once the client is made).

    Picklable (a DataLoader worker gets a copy): the fsspec client is made again in each
    process (an async client's event loop does not survive a fork)."""

    def __init__(self, url: str, retry: Retry):
        self.url, self.retry, self.stats = url, retry, FetchStats()
        self.shown = scrub(url)
        self.piece = retry.piece_bytes  # what the next read asks for at a time (bytes)
        self._fs, self._pid, self.path = None, None, ""

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fs": None, "_pid": None}

    def __repr__(self) -> str:
        return f"RemoteFolder({self.shown!r})"

    @property
    def fs(self):
        """This process's fsspec client for the folder."""
        if self._fs is None or self._pid != os.getpid():
            try:
                from fsspec.core import url_to_fs

                self._fs, self.path = url_to_fs(self.url)
            except ImportError as exc:
                raise StorageError(f"{self.shown}: {exc} ({install_hint(self.url)})") from exc
            except ValueError as exc:  # fsspec: "Protocol not known"
                raise StorageError(f"{self.shown}: {one_line(scrub(exc))}") from exc
            self._pid = os.getpid()
        return self._fs

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of file ``name`` (to its end when ``end`` is None), in
        pieces and retried as the module docstring says. StorageError for a permanent
        failure, a server that ignores ranges, or :attr:`Retry.attempts` tries in a row that
        brought nothing."""
        url, parts, at = self.url_of(name), [], start
        piece, failures, delay = self.piece, 0, self.retry.first_delay_s
        clean = True  # no failure in this read
        progressed = False  # a piece came since the last failure
        while end is None or at < end:
            stop = at + piece if end is None else min(at + piece, end)
            try:
                data = self._get(url, at, stop)
            except Exception as exc:  # noqa: BLE001 - classified: permanent or retried
                fix = permanent_failure(exc)
                if fix is not None:
                    raise StorageError(f"{scrub(url)}: {fix}") from None
                problem = f"{type(exc).__name__}: {one_line(scrub(exc)) or 'no message'}"
            else:
                self.stats.requests += 1
                self.stats.bytes += len(data)
                if len(data) > stop - at:
                    raise StorageError(f"{scrub(url)}: asked for bytes {at}-{stop}, got "
                                       f"{len(data)} bytes (a server that ignores Range "
                                       "requests cannot serve shards)")
                if data:
                    parts.append(data)
                    at += len(data)
                    progressed, failures, delay = True, 0, self.retry.first_delay_s
                    if end is None and at < stop:  # short of a whole piece: the file's end
                        break
                    if end is None:  # a file longer than a piece: read to its size
                        end = self.stated_size(name) or at
                    continue
                if end is None:  # nothing past ``at``: the file ends there
                    break
                problem = "empty body"
            clean = False
            if progressed:  # the link works: ask for the rest at once
                progressed = False
                self.stats.retries += 1
                continue
            failures += 1
            if failures >= self.retry.attempts:
                raise StorageError(f"{scrub(url)}: bytes {start}-{end if end else 'end'}: "
                                   f"{failures} tries in a row brought nothing ({problem}); "
                                   "check the network and the server, then resume the run")
            piece = self.piece = max(min(piece, end - at if end else piece) // 2, MIN_PIECE)
            halved = f", pieces of {piece >> 10} KiB" if end is None or piece < end - at else ""
            print(f"data: {scrub(url)} bytes {at}-{end if end else 'end'}: {problem}; retry "
                  f"{failures}/{self.retry.attempts - 1} in {delay:.2f} s{halved}",
                  file=sys.stderr, flush=True)
            self.stats.retries += 1
            self.stats.retry_s += delay
            time.sleep(delay)
            delay = min(2 * delay, self.retry.max_delay_s)
        if clean and at - start >= piece:  # a whole piece passed: try twice as much next
            self.piece = min(2 * piece, self.retry.piece_bytes)
        return b"".join(parts)

    def _get(self, url: str, start: int, end: int | None) -> bytes:
        """One request: fsspec's cat_file, under the request timeout where the client is
        asynchronous (fsspec's own ``timeout``: a stalled connection becomes an error)."""
        fs = self.fs
        timeout = {"timeout": self.retry.timeout_s} if getattr(fs, "async_impl", False) else {}
        return fs.cat_file(url, start=start or None, end=end, **timeout)

    def sizes(self, names: list[str]) -> dict[str, int]:
        """The sizes of those of ``names`` that exist: from one listing of the folder where
        the store lists it, else (a web server, a listing denied) one request each."""
        found = self.listing()
        missing = [n for n in names if n not in found]
        with ThreadPoolExecutor(16) as pool:
            for name, size in zip(missing, pool.map(self.stated_size, missing), strict=True):
                if size is not None:
                    found[name] = size
        return {n: found[n] for n in names if n in found}

    def listing(self) -> dict[str, int]:
        """The sizes of the files in the folder by name, from one fresh listing; ``{}``
        where the store does not list (a web server, a listing denied) or the folder is
        not there (yet)."""
        found: dict[str, int] = {}
        fs = self.fs  # a missing client is an error, not an empty listing
        try:
            fs.invalidate_cache(self.path)  # another process may have written since
            for entry in fs.ls(self.url, detail=True):
                if entry.get("size") is not None and entry.get("type") != "directory":
                    found[entry["name"].rstrip("/").rsplit("/", 1)[-1]] = int(entry["size"])
        except Exception:  # noqa: BLE001 - a folder that does not list: {}
            pass
        return found

    def stated_size(self, name: str) -> int | None:
        """File ``name``'s size as its store states it (fsspec's ``info``, one request on any
        scheme: an object's size, a web server's Content-Length), before any of it is read;
        None where the store states none, or no file (fsspec's web client says so of a 403
        too: the read that follows names what is wrong). StorageError when denied."""
        url = self.url_of(name)

        def size() -> int | None:
            try:
                stated = self.fs.info(url).get("size")
            except FileNotFoundError:
                return None
            return None if stated is None else int(stated)

        return self._retried(url, size)

    def copy_to(self, name: str, file: BinaryIO, size: int, block: int) -> str:
        """Write file ``name`` (``size`` bytes) into ``file`` in requests of ``block`` bytes;
        returns its SHA-256 (hex)."""
        digest = hashlib.sha256()
        for lo in range(0, size, block):
            data = self.read(name, lo, min(lo + block, size))
            digest.update(data)
            file.write(data)
        return digest.hexdigest()

    def upload(self, source: Path | bytes, name: str) -> None:
        """Store the local file (or the bytes) ``source`` as ``name``, retried as a read is.
        An object store makes an object visible only once its upload is whole, so a reader
        never meets half of one."""
        url = self.url_of(name)
        if isinstance(source, Path):
            self._retried(url, lambda: self.fs.put_file(str(source), url))
        else:
            self._retried(url, lambda: self.fs.pipe_file(url, source))

    def remove(self, name: str) -> None:
        """Delete file ``name`` (nothing when it is not there)."""
        url = self.url_of(name)

        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(url)

        self._retried(url, remove)

    def _retried(self, url: str, call: Callable[[], T]) -> T:
        """``call()``, retried on transient failures within :class:`Retry`'s bounds;
        StorageError at once for a permanent one, or when the tries run out."""
        failures = 0
        while True:
            try:
                return call()
            except Exception as exc:  # noqa: BLE001 - classified: permanent or retried
                fix = permanent_failure(exc)
                failures += 1
                if fix is not None or failures == self.retry.attempts:
                    raise StorageError(f"{scrub(url)}: {fix or one_line(scrub(exc))}") from None
            time.sleep(min(self.retry.first_delay_s * 2 ** (failures - 1),
                           self.retry.max_delay_s))


def permanent_failure(exc: BaseException) -> str | None:
    """What is wrong and the fix, for an error no retry cures (None: a transient one).

    Generic over the clients: fsspec turns a 404 or a missing bucket into FileNotFoundError
    and s3fs a 403 into PermissionError, gcsfs into an OSError saying "Forbidden" (HTTP's
    name for a 403); a plain HTTP status is the exception's ``status`` (aiohttp) or ``code``
    (gcsfs); a client without credentials raises a ``...Credentials...Error``."""
    status = getattr(exc, "status", None) or getattr(exc, "code", None)
    if isinstance(exc, FileNotFoundError) or status == 404:
        return ("not found (404, or no such bucket): check the URL; a converted folder holds "
                "manifest.json, its shards and their .idx files")
    if (isinstance(exc, PermissionError) or status in (401, 403)
            or type(exc) is OSError and str(exc).startswith("Forbidden")):
        return ("access denied (401/403): check the credentials in the client's standard places "
                "(AWS_* variables or profile, GOOGLE_APPLICATION_CREDENTIALS) and their rights "
                "on this prefix")
    if any("Credentials" in kind.__name__ for kind in type(exc).__mro__):
        return ("no credentials found: set them in the client's standard places (AWS_* "
                "variables or profile, GOOGLE_APPLICATION_CREDENTIALS, fsspec config)")
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
        return f"refused with HTTP {status}: check the URL and the server's access rules"
    return None
