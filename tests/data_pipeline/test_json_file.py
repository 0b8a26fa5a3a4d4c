"""``data_pipeline.json_file``: the one reader of JSON read back answers every bad file with one
line naming it, a size over the limit before the file is read; callers' error classes kept."""

from __future__ import annotations

import pytest

from data_pipeline.errors import DataError
from data_pipeline.json_file import parse_json, read_json


class Mine(ValueError):
    pass


@pytest.mark.parametrize("data, says", [
    (b"[" * 100_000, "RecursionError"),  # past the C scanner's recursion limit
    (b'{"a": 1', "JSONDecodeError"),
    (b"\xff\xfe\x00{}", "UnicodeDecodeError|JSONDecodeError"),
    (b"[1, 2]", "must be a JSON object, got list"),
    (b"x" * 101, "101 bytes, over the limit of 100"),
])
def test_a_bad_document_is_one_line_naming_its_file(data, says):
    with pytest.raises(DataError, match=says) as caught:
        parse_json(data, "run/meta.json", "checkpoint meta",
                   limit=100 if says.startswith("101") else 1 << 20)
    message = str(caught.value)
    assert message.startswith("run/meta.json: ") and "\n" not in message and len(message) < 300


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    path.write_bytes(b"{}" + b" " * 200)
    monkeypatch.setattr(type(path), "read_bytes", lambda self: pytest.fail("read"))
    with pytest.raises(Mine, match=r"manifest\.json: 202 bytes, over the limit of 100"):
        read_json(path, "manifest", limit=100, error=Mine)


def test_a_good_file_and_a_missing_one(tmp_path):
    (tmp_path / "a.json").write_text('{"step": 3}')
    assert read_json(tmp_path / "a.json", "meta") == {"step": 3}
    with pytest.raises(DataError, match=r"b\.json: cannot read meta \(No such file"):
        read_json(tmp_path / "b.json", "meta", where=str(tmp_path / "b.json"))
