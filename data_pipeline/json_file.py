"""The one reader of the JSON files the project writes and reads back.

``manifest.json``, ``identities.json`` and a conversion's progress file, a checkpoint's
``meta.json``, the run lock's lease, the run's line files (``metrics.jsonl``), ``launch.embed``'s
``embeddings.json`` and ``launch.evaluate --json``'s results all arrive from disk or a store,
where anything can have replaced them. Each comes through the door (:mod:`data_pipeline.door`:
a file's size from ``stat``, a store's from the store, checked before it is read) and is parsed
by :func:`parse_json`, whose failures are one line naming the file: malformed JSON, bytes that are
not UTF-8, nesting deeper than the parser's recursion limit (a ``RecursionError`` from
``json``'s C scanner), or a value of the wrong type at the top. Callers pass their own error
class (a checkpoint's ``CheckpointError``, a report's ``ReportError``), so the exit code and
scope stay theirs.

It lives beside the storage layer (``data_pipeline.remote``, ``data_pipeline.store``), below
``trainer/``, so both packages use it (``trainer.pretrained`` reads an exported model's
``config.json`` with it for ``partial_fc``, which imports neither).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from data_pipeline.door import check_size, fetch_bytes, read_bytes
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
    check_size(len(data), where, what, limit, error)
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
    """The JSON file ``path`` (:func:`parse_json`), through the door
    (:func:`data_pipeline.door.read_bytes`: its size checked before it is read); ``error``
    naming it (or ``where``: the URL a local copy came from) when it cannot be read."""
    where = str(path) if where is None else where
    data = read_bytes(path, what, limit=limit, error=error, where=where)
    return parse_json(data, where, what, expect=expect, limit=limit, error=error)


def fetch_json(folder: RemoteFolder, name: str, what: str, *, size: int | None = None,
               limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON object in file ``name`` of the folder at a URL ``folder``
    (:func:`parse_json`), refused before a byte of it is fetched when it holds more than
    ``limit`` (:func:`data_pipeline.door.fetch_bytes`)."""
    from data_pipeline.remote import scrub

    data = fetch_bytes(folder, name, what, limit=limit, size=size)
    return parse_json(data, scrub(folder.url_of(name)), what, limit=limit)
