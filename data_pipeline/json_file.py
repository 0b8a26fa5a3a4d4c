"""The one reader of the JSON files the project writes and reads back.

``manifest.json``, ``identities.json`` and a conversion's progress file, a checkpoint's
``meta.json``, the run lock's lease, the run's line files (``metrics.jsonl``), ``launch.embed``'s
``embeddings.json`` and ``launch.evaluate --json``'s results all arrive from disk or a store,
where anything can have replaced them. Each is size-checked before it is read (a file's size
from ``stat``; a store's from the store, :func:`fetch_json`) and parsed by
:func:`parse_json`, whose failures are one line naming the file: malformed JSON, bytes that are
not UTF-8, nesting deeper than the parser's recursion limit (a ``RecursionError`` from
``json``'s C scanner), or a value of the wrong type at the top. Callers pass their own error
class (a checkpoint's ``CheckpointError``, a report's ``ReportError``), so the exit code and
scope stay theirs.

It lives beside the storage layer (``data_pipeline.remote``, ``data_pipeline.store``), below
``trainer/``, so both packages use it. ``partial_fc`` imports neither and parses the one JSON
file it reads (an exported model's ``config.json``) itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from data_pipeline.errors import DataError

if TYPE_CHECKING:
    from data_pipeline.remote import RemoteFolder

MAX_JSON_BYTES = 64 << 20
"""Default size limit: a ``manifest.json`` of WebFace42M's 42k shards is 6 MB; a checkpoint's
``meta.json``, a lease, a metrics line are kilobytes. ``identities.json`` gets
:data:`MAX_IDENTITIES_BYTES`."""
MAX_IDENTITIES_BYTES = 512 << 20  # one name per class: 40 MB for 2M identities


def parse_json(data: bytes | str, where: str, what: str, *, expect: type | None = dict,
               limit: int = MAX_JSON_BYTES, error: type[Exception] = DataError) -> Any:
    """``data`` parsed as JSON; ``error`` (one line naming ``where`` and ``what`` the file is)
    when it is over ``limit`` bytes, not UTF-8 JSON, nested too deep, or (with ``expect``) not
    of that type at the top."""
    _check_size(len(data), where, what, limit, error)
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise error(f"{where}: malformed {what} ({type(exc).__name__}: "
                    f"{str(exc)[:120]})") from None
    if expect is not None and not isinstance(value, expect):
        raise error(f"{where}: {what} must be a JSON "
                    f"{'object' if expect is dict else expect.__name__}, "
                    f"got {type(value).__name__}")
    return value


def read_json(path: str | Path, what: str, *, expect: type | None = dict,
              limit: int = MAX_JSON_BYTES, error: type[Exception] = DataError,
              where: str | None = None) -> Any:
    """The JSON file ``path`` (:func:`parse_json`), its size checked before it is read;
    ``error`` naming it (or ``where``: the URL a local copy came from) when it cannot be
    read."""
    path = Path(path)
    where = str(path) if where is None else where
    try:
        _check_size(path.stat().st_size, where, what, limit, error)
        data = path.read_bytes()
    except OSError as exc:
        raise error(f"{where}: cannot read {what} ({exc.strerror or type(exc).__name__})"
                    ) from None
    return parse_json(data, where, what, expect=expect, limit=limit, error=error)


def fetch_json(folder: RemoteFolder, name: str, what: str, *, size: int | None = None,
               limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON object in file ``name`` of the folder at a URL ``folder``
    (:func:`parse_json`), refused before a byte of it is fetched when it holds more than
    ``limit``: its size is ``size`` where a listing gave it, else what the store states
    (``RemoteFolder.stated_size``); a store that states none is checked once fetched."""
    from data_pipeline.remote import scrub

    where = scrub(folder.url_of(name))
    size = folder.stated_size(name) if size is None else size
    if size is not None:
        _check_size(size, where, what, limit, DataError)
    return parse_json(folder.read(name), where, what, limit=limit)


def _check_size(size: int, where: str, what: str, limit: int, error: type[Exception]) -> None:
    """``error`` (one line) when a file of ``size`` bytes is over ``limit``."""
    if size > limit:
        raise error(f"{where}: {size} bytes, over the limit of {limit} for {what}")
