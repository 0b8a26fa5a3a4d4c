"""The door (``data_pipeline.door``): a file over its reader's limit is refused from its size
before a byte is read, one that is no regular file (``/dev/zero``, a FIFO) is read no further
than the limit, and text that is not UTF-8 is one line naming the byte."""

from __future__ import annotations

import os
import threading

import pytest

from data_pipeline.door import is_index, read_bytes, read_text
from data_pipeline.errors import DataError


class Mine(Exception):
    """A reader's own error class: the door raises it."""


def test_a_file_is_read_whole_within_its_limit_and_refused_past_it(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert read_bytes(path, "a file", limit=100) == b"x" * 100
    with pytest.raises(Mine, match=rf"^{path}: 100 bytes, over the limit of 99 for a file$"):
        read_bytes(path, "a file", limit=99, error=Mine)
    with open(path, "wb") as f:
        f.truncate(1 << 40)  # a terabyte of hole: refused from stat, nothing read
    with pytest.raises(DataError, match=f"{1 << 40} bytes, over the limit"):
        read_bytes(path, "a file", limit=1 << 20)


def test_what_is_no_regular_file_is_read_no_further_than_the_limit(tmp_path):
    with pytest.raises(DataError, match="/dev/zero: 1025 bytes, over the limit of 1024"):
        read_bytes("/dev/zero", "zeros", limit=1024)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(b"hello"))
    writer.start()
    assert read_bytes(fifo, "a pipe", limit=1024) == b"hello"
    writer.join()


def test_text_is_utf8_and_a_missing_file_names_the_fix(tmp_path):
    path = tmp_path / "list.txt"
    path.write_bytes(b"ok\n\xff")
    with pytest.raises(DataError, match=rf"^{path}: cannot read a list \(not UTF-8: invalid "
                       r"start byte at byte 3\)$"):
        read_text(path, "a list", limit=100)
    with pytest.raises(DataError, match=r"cannot read a list \(No such file or directory\); "
                       "write one with X$"):
        read_text(tmp_path / "gone", "a list", limit=100, hint="; write one with X")


@pytest.mark.parametrize("word, index", [("0", True), ("000000000012", True),
                                         ("1234567890123", False), ("²", False), ("", False),
                                         ("-1", False), ("1 ", False)])
def test_an_index_is_1_to_12_ascii_digits(word, index):
    assert is_index(word) is index
