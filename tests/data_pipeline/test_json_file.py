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


@pytest.fixture
def store():
    """A folder in fsspec's memory store: read through RemoteFolder (not a local path), as a
    bucket is; removed afterwards (the store is the process's)."""
    import uuid

    import fsspec

    fs, url = fsspec.filesystem("memory"), f"memory://readers-{uuid.uuid4().hex[:8]}"
    yield fs, url
    fs.rm(url, recursive=True)


def test_files_in_a_store_over_their_limit_are_refused_before_they_are_fetched(
        store, monkeypatch, tmp_path):
    """The manifest, the identity map and a conversion's progress file at a URL: the size the
    store states (or its listing gives) is checked before a byte is fetched."""
    from data_pipeline import read_manifest, write_dataset
    from data_pipeline.identities import read_identities
    from data_pipeline.json_file import MAX_JSON_BYTES, fetch_json
    from data_pipeline.manifest import Manifest
    from data_pipeline.remote import RemoteFolder, open_folder
    from data_pipeline.synthetic import SyntheticSource

    fs, url = store
    huge = b"{}" + b" " * MAX_JSON_BYTES  # one byte over
    fs.pipe({f"{url}/set/manifest.json": huge, f"{url}/out/.convert.json": huge,
             f"{url}/set/identities.json": b'{"origin": "x", "names": ["a", "b"]}'})
    folder = open_folder(f"{url}/set")
    assert isinstance(folder, RemoteFolder)
    assert read_identities(folder, Manifest(2, 2, (), identities="identities.json")).names == (
        "a", "b")
    monkeypatch.setattr(RemoteFolder, "read", lambda *a, **k: pytest.fail("fetched"))
    over = rf"{MAX_JSON_BYTES + 2} bytes, over the limit of {MAX_JSON_BYTES} for"
    with pytest.raises(DataError, match=rf"^{url}/set/manifest\.json: {over} manifest$"):
        read_manifest(folder)
    with pytest.raises(DataError, match=r"identities\.json: 36 bytes, over the limit of 35"):
        fetch_json(folder, "identities.json", "identity map", limit=35)
    with pytest.raises(DataError, match=rf"out/\.convert\.json: {over} conversion progress"):
        write_dataset(SyntheticSource(num_classes=2, images_per_class=1), f"{url}/out")
