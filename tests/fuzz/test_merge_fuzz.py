"""Fuzzing merge lists (``data.merge``, read at ``--check`` and by the loader; written by
``launch.overlap --between``): whatever the file holds, the list (its pairs joined over the
classes of two folders of 50) or one line naming it, within the bounds of tests/fuzz/bounds.py.

Seed: a valid list as ``write_merge`` writes it, damaged, or random bytes. A list that reads is
held to a reference: its people are the connected components of its pairs over the 100
classes (scipy's ``connected_components``), which the labels, their count and
:func:`merged_count` must match."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from data_pipeline.errors import DataError
from data_pipeline.merge import (
    Content,
    check_folders,
    merged_count,
    merged_labels,
    read_merge,
    write_merge,
)
from tests.fuzz.bounds import damaged, fuzz_settings, one_line

FOLDERS = ["/data/a", "/data/b"]


def _seed() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "merge.txt"
        write_merge(path, FOLDERS, [Content(50, "0123456789abcdef")] * 2,
                    [((0, 3), (1, 7), 0.91, "x (5 images) = x (4 images)"),
                     ((0, 4), (0, 9), 0.72, "y = z")], header="launch.overlap")
        return path.read_bytes()


SEED = _seed()


@fuzz_settings(examples=20)
@given(data=damaged(SEED) | st.binary(max_size=300))
def test_merge_lists(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "merge.txt"
        path.write_bytes(data)
        try:
            merge = read_merge(path)
            check_folders(merge, FOLDERS)
            labels = merged_labels(merge, [50, 50])
        except DataError as err:
            assert one_line(err, (DataError,)).startswith(str(path))
            return
    people, person = _people(merge)
    assert labels.shape == (100,) and labels.max() + 1 == people == merged_count(merge, [50, 50])
    assert np.array_equal(labels[:, None] == labels, person[:, None] == person)
    firsts = np.unique(labels, return_index=True)[1]  # each label's first class, in label order
    assert np.all(np.diff(firsts) > 0)


def _people(merge) -> tuple[int, np.ndarray]:
    """The reference: how many people, and each class's component."""
    ends = np.array([[50 * s + c for s, c in pair] for pair in merge.pairs],
                    np.int64).reshape(-1, 2)
    graph = coo_matrix((np.ones(len(ends)), (ends[:, 0], ends[:, 1])), shape=(100, 100))
    return connected_components(graph, directed=False)


def test_the_seed_is_a_list():
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "m.txt").write_bytes(SEED)
        merge = read_merge(Path(tmp) / "m.txt")
        assert merged_labels(merge, [50, 50]).max() + 1 == 98 == merged_count(merge, [50, 50])
