"""Shard member indexes: the loader reads the same samples through them as by parsing the
tars, a stale or damaged index is refused with a line naming the fix, and `launch.convert
index` / `verify` build and check them."""

import numpy as np
import pytest
import torch
from shard_helpers import make_shards

from data_pipeline import make_loader, read_manifest
from data_pipeline.errors import ShardError
from data_pipeline.shard_index import (
    build_index,
    index_path,
    indexed_samples,
    read_index,
    write_index,
)
from data_pipeline.tar_reader import BLOCK, tar_samples
from data_pipeline.verify import verify_dataset
from launch import convert


def _drop_indexes(folder):
    for shard in read_manifest(folder).shards:
        index_path(folder / shard.name).unlink()


@pytest.fixture()
def folder(tmp_path):
    """Three shards with undecodable samples and one image of another size."""
    return make_shards(tmp_path / "data", [9, 12, 7], corrupt={2, 13, 14}, odd_size={20})


def test_indexed_reads_equal_the_tar_parse(folder):
    path = folder / read_manifest(folder).shards[1].name
    index = read_index(path)
    assert index is not None and len(index.keys) == 12
    for start, stop, drop in [(0, 12, ()), (3, 9, ()), (2, 11, frozenset({4, 7, 10})),
                              (11, 12, ()), (5, 5, ())]:
        want = list(tar_samples(path, start, stop, drop, exts=("jpg", "cls")))
        got = list(indexed_samples(path, index, [p for p in range(start, stop) if p not in drop]))
        assert got == want and len(got) == stop - start - len(drop)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_yields_the_same_epoch_with_or_without_indexes(folder, workers):
    def epoch_and_resume():
        loader = make_loader(folder, batch_size=4, num_workers=workers, seed=3, with_keys=True,
                             shuffle_buffer=5)
        batches = [(images.clone(), labels, keys) for images, labels, keys in loader]
        skipped = loader.num_skipped
        resumed = make_loader(folder, batch_size=4, num_workers=workers, seed=3,
                              with_keys=True, shuffle_buffer=5)
        it = iter(resumed)
        next(it)
        state = resumed.state_dict()
        del it
        resumed.load_state_dict(state)
        rest = sorted(k for _, _, keys in resumed for k in keys)
        return batches, skipped, rest, loader.num_unindexed

    indexed = epoch_and_resume()
    _drop_indexes(folder)
    parsed = epoch_and_resume()
    assert indexed[3] == 0 and parsed[3] == 3
    assert len(indexed[0]) == len(parsed[0]) == 7 and indexed[1] == parsed[1] == 3
    for (a_img, a_lab, a_keys), (b_img, b_lab, b_keys) in zip(indexed[0], parsed[0],
                                                               strict=True):
        assert a_keys == b_keys and torch.equal(a_lab, b_lab) and torch.equal(a_img, b_img)
    assert indexed[2] == parsed[2] and len(indexed[2]) == 6 * 4


def test_a_rewritten_shard_or_a_damaged_index_is_refused_naming_the_fix(folder):
    path = folder / read_manifest(folder).shards[0].name
    index = read_index(path)
    first_jpg = int(index.members[0, 0])
    data = bytearray(path.read_bytes())
    data[first_jpg - BLOCK] ^= 1  # the first member's name changes, the size does not
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"\.tar\.idx: does not match shard-000000\.tar .*"
                       r"launch\.convert index"):
        list(indexed_samples(path, read_index(path), list(range(9))))
    index_path(path).write_bytes(b"not an index")
    with pytest.raises(ShardError, match=r"\.tar\.idx: unreadable shard index .*launch\.conv"):
        read_index(path)


def test_convert_index_builds_what_the_writer_wrote_and_verify_checks_it(folder, capsys):
    written = {s.name: read_index(folder / s.name) for s in read_manifest(folder).shards}
    _drop_indexes(folder)
    assert convert.main(["index", str(folder), "--workers", "2"]) == 0
    assert "3 shards indexed" in capsys.readouterr().out
    for name, want in written.items():
        got = read_index(folder / name)
        assert got.keys.tolist() == want.keys.tolist()
        assert np.array_equal(got.members, want.members) and got.shard_bytes == want.shard_bytes
    report = verify_dataset(folder)
    assert not report.problems
    shard = folder / "shard-000002.tar"
    stale = build_index(shard)
    stale.members[[0, 1]] = stale.members[[1, 0]]  # two samples' offsets swapped
    write_index(shard, stale)
    assert verify_dataset(folder).problems == [
        f"{index_path(shard)}: does not match its shard; rebuild the folder's indexes with "
        "`python -m launch.convert index DIR` (or delete the file: the loader then parses the "
        "tar)"]
