"""The one door a file from outside the project comes in by: its bytes, bounded, and its text.

Every reader of ``data_pipeline``, ``trainer``, ``offline`` and ``launch`` gets a file's bytes
from :func:`read_bytes` (a path) or :func:`fetch_bytes` (a file of a folder at a URL): the
file's size (``stat``; at a URL what the store states, ``RemoteFolder.stated_size``) is checked
against a limit the caller names before a byte is read, and the read stops one byte past the
limit, so a file that grows, a FIFO or ``/dev/zero`` is refused too. :func:`decode_text` makes
UTF-8 text of them with a named error. The formats then have their own homes, each reading
through this door: JSON (:mod:`data_pipeline.json_file`), YAML (``trainer.yaml_file``), NumPy
archives (:mod:`data_pipeline.npz_file`), MATLAB files (:mod:`data_pipeline.mat_file`), a
pickled ``.bin`` (:mod:`data_pipeline.verification_bin`), images
(:mod:`data_pipeline.codec`). ``tests/test_one_door.py`` fails where a module outside them
reads a file another way (docs/readers.md).

A refusal is one line naming the file (``where``) and what it is (``what``); callers pass
their own error class, so the exit code and scope stay theirs.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from data_pipeline.errors import DataError

if TYPE_CHECKING:
    from data_pipeline.remote import RemoteFolder

_INDEX = re.compile(r"[0-9]{1,12}")  # a set, class or image number: ASCII digits, < 10^12


def check_size(size: int, where: str, what: str, limit: int,
               error: type[Exception] = DataError) -> None:
    """``error`` (one line) when a file of ``size`` bytes is over ``limit``."""
    if size > limit:
        raise error(f"{where}: {size} bytes, over the limit of {limit} for {what}")


def read_bytes(path: str | os.PathLike, what: str, *, limit: int,
               error: type[Exception] = DataError, where: str | None = None,
               hint: str = "") -> bytes:
    """The bytes of file ``path`` (named ``where``, by default the path), refused before
    the read when ``stat`` says it holds more than ``limit``, and read no further than
    ``limit`` + 1 bytes. ``error`` naming it and ``what`` it is, with ``hint`` (``; write
    one with ...``) after a file that cannot be read."""
    where = str(path) if where is None else where
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            check_size(size, where, what, limit, error)
            data = f.read(size + 1)  # a buffer of the size read, not of the limit
            if len(data) > size:  # grown since, or not a regular file (a FIFO states 0)
                data += f.read(limit + 1 - len(data))
    except OSError as exc:
        raise error(f"{where}: cannot read {what} ({exc.strerror or type(exc).__name__})"
                    f"{hint}") from None
    check_size(len(data), where, what, limit, error)
    return data


def fetch_bytes(folder: RemoteFolder, name: str, what: str, *, limit: int,
                size: int | None = None, error: type[Exception] = DataError) -> bytes:
    """The bytes of file ``name`` of the folder at a URL ``folder``, refused before a byte
    is fetched when it holds more than ``limit``: its size is ``size`` where a listing gave
    it, else what the store states (``RemoteFolder.stated_size``); a store that states none
    (a web server without Content-Length) is checked once fetched."""
    from data_pipeline.remote import scrub

    where = scrub(folder.url_of(name))
    size = folder.stated_size(name) if size is None else size
    if size is not None:
        check_size(size, where, what, limit, error)
    data = folder.read(name)
    check_size(len(data), where, what, limit, error)
    return data


def decode_text(data: bytes, where: str, what: str,
                error: type[Exception] = DataError) -> str:
    """``data`` as UTF-8 text; ``error`` naming the file and the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where}: cannot read {what} (not UTF-8: {exc.reason} at byte "
                    f"{exc.start})") from None


def read_text(path: str | os.PathLike, what: str, *, limit: int,
              error: type[Exception] = DataError, where: str | None = None,
              hint: str = "") -> str:
    """:func:`read_bytes` of ``path`` as UTF-8 text (:func:`decode_text`)."""
    where = str(path) if where is None else where
    return decode_text(read_bytes(path, what, limit=limit, error=error, where=where,
                                  hint=hint), where, what, error)


def is_index(word: str) -> bool:
    """Whether ``word`` is a set, class or image number as the project's lists write one:
    1-12 ASCII digits (``str.isdigit`` takes ``²``, which ``int`` refuses, and 5,000 digits,
    which ``int`` takes slowly)."""
    return _INDEX.fullmatch(word) is not None

