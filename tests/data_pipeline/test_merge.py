"""Merge lists (``data_pipeline.merge``): what ``launch.overlap --between`` writes reads back,
struck lines and notes do not count (nor change the digest), a bad line is named
``file:line``, pairs chain into one label per person, and a set whose folder no longer holds
what the list was made from is refused naming the set."""

from __future__ import annotations

import numpy as np
import pytest

from data_pipeline.errors import DataError
from data_pipeline.manifest import read_manifest
from data_pipeline.merge import (
    Content,
    MergeList,
    check_contents,
    check_folders,
    content_of,
    merged_count,
    merged_labels,
    read_merge,
    write_merge,
)

HELD = [Content(50, "0123456789abcdef"), Content(60, "fedcba9876543210")]


def test_a_written_list_reads_back_and_struck_lines_are_ignored(tmp_path):
    path = tmp_path / "merge.txt"
    write_merge(path, ["/d/a", "/d/b"], HELD,
                [((0, 3), (1, 7), 0.91, "x (5 images) = x (4 images)"),
                 ((0, 4), (1, 2), 0.72, "y = z")], header="tool a=1")
    text = path.read_text()
    assert text.startswith("# tool a=1\nset 0 /d/a 50 0123456789abcdef\n"
                           "set 1 /d/b 60 fedcba9876543210\npair 0:3 1:7 0.9100  # x (5")
    merge = read_merge(path)
    assert merge.sets == ("/d/a", "/d/b") and merge.pairs == (((0, 3), (1, 7)), ((0, 4), (1, 2)))
    assert merge.contents == tuple(HELD)
    path.write_text(text.replace("pair 0:4", "- pair 0:4").replace("# x (5", "# edited (5"))
    struck = read_merge(path)
    assert struck.pairs == (((0, 3), (1, 7)),)
    assert struck.digest != merge.digest
    assert struck.digest == MergeList(("/d/a", "/d/b"), (((1, 7), (0, 3)),)).digest  # order


@pytest.mark.parametrize("line, says", [
    ("pair 0:1 1-2", "'1-2' is not SET:CLASS"),
    ("pair 0:1 1:2 1.5", "'1.5' is not a cosine in [-1, 1]"),
    ("class 3", "is not 'set I FOLDER CLASSES DIGEST' or 'pair I:CLASS J:CLASS [COSINE]'"),
    ("set 0 /d/other", "set 0 named twice (/d/a, /d/other)"),
    ("set 1 /d/b ² 0123456789abcdef", "'²' '0123456789abcdef' is not CLASSES DIGEST"),
    ("set 1 /d/b 12 0123", "'12' '0123' is not CLASSES DIGEST"),
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


def test_a_folder_converted_again_is_refused_naming_the_set(tmp_path, synthetic_data):
    """The same class count in another label order would merge the wrong people: the digest
    of its identities tells them apart."""
    import json
    import shutil

    folder = shutil.copytree(synthetic_data, tmp_path / "set")
    held = content_of(folder)
    assert held.classes == 20 and held == content_of(str(folder))
    merge = MergeList((str(folder),), (((0, 1), (0, 2)),), "m", (held,))
    check_contents(merge, [str(folder)], [read_manifest(folder)])
    names = json.loads((folder / "identities.json").read_text())
    names["names"] = names["names"][::-1]  # converted again: the labels in another order
    (folder / "identities.json").write_text(json.dumps(names))
    with pytest.raises(DataError) as err:
        check_contents(merge, [str(folder)], [read_manifest(folder)])
    assert str(err.value) == (
        f"m: set 0: {folder} holds 20 classes (digest {content_of(folder).digest}), the list "
        f"was made from 20 (digest {held.digest}): converted again since; write the list again "
        "with python -m launch.overlap --between")
    older = MergeList((str(folder),), (), "m", (None,))  # a list from before sets held it
    with pytest.raises(DataError, match=rf"m: set 0 records no class count .* end its set line "
                       rf"with '20 {content_of(folder).digest}'"):
        check_contents(older, [str(folder)], [read_manifest(folder)])


def test_the_merged_count_is_the_labels_count_without_sizing_the_classes():
    merge = MergeList(("a", "b"), (((0, 1), (1, 0)), ((1, 0), (1, 2)), ((0, 3), (0, 0))), "m")
    assert merged_count(merge, [4, 3]) == 4 == merged_labels(merge, [4, 3]).max() + 1
    assert merged_count(merge, [10**12, 10**12]) == 2 * 10**12 - 3  # nothing of that size made
