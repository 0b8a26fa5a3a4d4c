"""``launch.convert`` into a URL (moto's S3 server on loopback, the ``s3_store`` fixture):
shards uploaded as they are finished, the manifest last, so an interrupted conversion is
refused by every reader and a rerun finishes it as a local conversion would; ``verify`` on a
URL; a web server refused as an output."""

import fsspec
import pytest
from shard_helpers import jpeg

from data_pipeline import make_loader
from data_pipeline.imagefolder import ImageFolderSource
from data_pipeline.remote import StorageError
from data_pipeline.writer import write_dataset
from launch.convert import main


@pytest.fixture
def source(tmp_path):
    """An image folder of 3 identities, 11 images."""
    for i in range(11):
        path = tmp_path / "src" / f"id{i % 3}" / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(jpeg(i % 3))
    return tmp_path / "src"


class FailsReading:
    """``source`` whose reads of the items in ``failing`` raise: a conversion that dies there
    (its description is the source's: a rerun with the source itself resumes it)."""

    def __init__(self, source, failing):
        self.source, self.failing, self.num_classes = source, failing, source.num_classes

    def __len__(self):
        return len(self.source)

    def describe(self):
        return self.source.describe()

    def identity_map(self):
        return self.source.identity_map()

    def read(self, index):
        if index in self.failing:
            raise RuntimeError(f"source item {index} unreadable")
        return self.source.read(index)


def _stored(url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return {p.rsplit("/", 1)[-1]: fs.cat_file(p) for p in fs.ls(root, detail=False)}


def test_an_interrupted_upload_has_no_manifest_and_a_rerun_finishes_it(
        source, tmp_path, monkeypatch, s3_store, capsys):
    url = "s3://bucket/converted"
    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.setenv("TMPDIR", str(staging))
    monkeypatch.setattr("tempfile.tempdir", None)  # TMPDIR read again
    # in source order, 3 samples a shard: the conversion dies in the third shard
    options = {"samples_per_shard": 3, "shuffle_seed": None}
    with pytest.raises(RuntimeError, match="item 7 unreadable"):
        write_dataset(FailsReading(ImageFolderSource(source), {7}), url, **options)
    stored = _stored(url)
    assert sorted(stored) == [".convert.json", "shard-000000.tar", "shard-000000.tar.idx",
                              "shard-000001.tar", "shard-000001.tar.idx"]
    assert list(staging.iterdir()) == []  # each shard deleted once uploaded
    # a reader refuses the prefix in one line: it has no manifest
    with pytest.raises(StorageError, match=r"converted/manifest\.json: not found") as refused:
        make_loader(url, batch_size=2, num_workers=0)
    assert "\n" not in str(refused.value)
    assert main(["verify", url]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "manifest.json: not found" in err
    # the rerun keeps the uploaded shards (it reads none of their source items again)
    resumed = FailsReading(ImageFolderSource(source), {0, 1, 2, 3, 4, 5})
    manifest, _ = write_dataset(resumed, url, **options)
    assert len(manifest.shards) == 4 and list(staging.iterdir()) == []
    # the same files as a local conversion, the progress file gone
    local = tmp_path / "local"
    write_dataset(ImageFolderSource(source), local, **options)
    stored = _stored(url)
    assert sorted(stored) == sorted(p.name for p in local.iterdir())
    assert all(stored[name] == (local / name).read_bytes() for name in stored)
    assert main(["verify", url]) == 0
    assert "11 samples checked, 3 of 3 classes present" in capsys.readouterr().out
    # and the loader reads the URL as the local folder
    read = [[(labels.tolist(), keys) for _, labels, keys in make_loader(
        folder, batch_size=2, num_workers=0, with_keys=True)] for folder in (url, local)]
    assert read[0] == read[1] and len(read[0]) == 5


def test_convert_and_verify_a_url_through_the_launcher(source, tmp_path, s3_store, capsys):
    url = "s3://bucket/launcher"
    assert main(["imagefolder", str(source), url, "--samples-per-shard", "4"]) == 0
    assert f"{url}: 11 samples, 3 classes, 3 shards" in capsys.readouterr().out
    assert main(["verify", url, "--workers", "2"]) == 0
    assert "OK" in capsys.readouterr().out
    # a shard rewritten behind the manifest's back: verify names it at its URL, exit 1
    fs = fsspec.filesystem("s3")
    fs.pipe_file(f"{url}/shard-000001.tar", b"\0" * 1024)
    assert main(["verify", url]) == 1
    out = capsys.readouterr()
    assert f"{url}/shard-000001.tar: 1024 bytes, manifest says" in out.err
    assert "1 shard problems: FAILED" in out.out
    # another conversion into the same prefix is refused, naming its manifest
    assert main(["imagefolder", str(source), url, "--samples-per-shard", "5"]) == 2
    assert f"{url}/manifest.json: folder already holds a different" in capsys.readouterr().err


def test_outputs_refused_in_one_line_and_a_file_url_written_as_a_folder(
        source, tmp_path, s3_store, capsys):
    assert main(["imagefolder", str(source), "https://127.0.0.1:9/set"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the bar's start
    assert err == ("error: https://127.0.0.1:9/set: a web server is read-only; convert into a "
                   "local folder or an object store (s3://, gs://) and serve that")
    assert main(["imagefolder", str(source), "s3://no-such-bucket/set"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: s3://no-such-bucket/set/.convert.json: not found (404, or no "
                          "such bucket)")
    assert main(["imagefolder", str(source), f"file://{tmp_path}/via-file"]) == 0
    assert main(["verify", str(tmp_path / "via-file")]) == 0
