"""Merge lists (``data_pipeline.merge``): what ``launch.overlap --between`` writes reads back,
struck lines and notes do not count (nor change the digest), a bad line is named
``file:line``, and pairs chain into one label per person."""

from __future__ import annotations

import numpy as np
import pytest

from data_pipeline.errors import DataError
from data_pipeline.merge import (
    MergeList,
    check_folders,
    merged_labels,
    read_merge,
    write_merge,
)


def test_a_written_list_reads_back_and_struck_lines_are_ignored(tmp_path):
    path = tmp_path / "merge.txt"
    write_merge(path, ["/d/a", "/d/b"], [((0, 3), (1, 7), 0.91, "x (5 images) = x (4 images)"),
                                         ((0, 4), (1, 2), 0.72, "y = z")], header="tool a=1")
    text = path.read_text()
    assert text.startswith("# tool a=1\nset 0 /d/a\nset 1 /d/b\npair 0:3 1:7 0.9100  # x (5")
    merge = read_merge(path)
    assert merge.sets == ("/d/a", "/d/b") and merge.pairs == (((0, 3), (1, 7)), ((0, 4), (1, 2)))
    path.write_text(text.replace("pair 0:4", "- pair 0:4").replace("# x (5", "# edited (5"))
    struck = read_merge(path)
    assert struck.pairs == (((0, 3), (1, 7)),)
    assert struck.digest != merge.digest
    assert struck.digest == MergeList(("/d/a", "/d/b"), (((1, 7), (0, 3)),)).digest  # order


@pytest.mark.parametrize("line, says", [
    ("pair 0:1 1-2", "'1-2' is not SET:CLASS"),
    ("pair 0:1 1:2 1.5", "'1.5' is not a cosine in [-1, 1]"),
    ("class 3", "is not 'set I FOLDER' or 'pair I:CLASS J:CLASS [COSINE]'"),
    ("set 0 /d/other", "set 0 named twice (/d/a, /d/other)"),
])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, line, says):
    path = tmp_path / "m.txt"
    path.write_text(f"# header\nset 0 /d/a\n{line}\n")
    with pytest.raises(DataError, match="^" + str(path).replace(".", r"\.") + ":3: "):
        read_merge(path)
    with pytest.raises(DataError) as err:
        read_merge(path)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_whole_file_refusals(tmp_path):
    path = tmp_path / "m.txt"
    for text, says in (("set 1 /d/b\n", r"sets \[1\]: number them 0, 1"),
                       ("set 0 /d/a\npair 0:1 1:1\n", "pair 1 names set 1"),
                       ("set 0 /d/a\npair 0:1 0:1\n", "joins 0:1 with itself")):
        path.write_text(text)
        with pytest.raises(DataError, match=says):
            read_merge(path)
    with pytest.raises(DataError, match="cannot read the merge list"):
        read_merge(tmp_path / "missing.txt")


def test_pairs_chain_into_one_label_per_person_in_order_of_first_class():
    merge = MergeList(("a", "b"), (((0, 1), (1, 0)), ((1, 0), (1, 2)), ((0, 3), (0, 0))), "m")
    assert merged_labels(merge, [4, 3]).tolist() == [0, 1, 2, 0, 1, 3, 1]
    assert merged_labels(MergeList(("a",), ()), [3]).tolist() == [0, 1, 2]
    with pytest.raises(DataError, match="m: pair 0:1 1:0: set 1 has 0 classes"):
        merged_labels(merge, [4, 0])
    big = MergeList(("a", "b"), tuple(((0, c), (1, c)) for c in range(0, 100_000, 2)))
    labels = merged_labels(big, [100_000, 100_000])
    assert labels.max() + 1 == 150_000 and np.array_equal(labels[100_000::2], labels[:100_000:2])


def test_the_sets_must_be_the_run_s_folders_in_order(tmp_path):
    merge = MergeList((str(tmp_path / "a"), str(tmp_path / "b")), (), "m")
    check_folders(merge, [str(tmp_path / "a"), f"{tmp_path}/./b", str(tmp_path / "c")])
    with pytest.raises(DataError, match=r"m: set 0 is .*/a, but data.dirs\[0\] is .*/b"):
        check_folders(merge, [str(tmp_path / "b"), str(tmp_path / "a")])
    with pytest.raises(DataError, match="m: 2 sets, but the run has 1 data folder"):
        check_folders(merge, [str(tmp_path / "a")])
