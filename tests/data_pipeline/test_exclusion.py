"""Exclusion lists: the shared file format, and ``data.exclude`` in the loader (excluded
samples never read, every kept sample once per epoch, exact resume)."""

import re

import numpy as np
import pytest
from shard_helpers import epoch_keys, make_shards

from data_pipeline import epoch_plan, make_loader
from data_pipeline.errors import DataError
from data_pipeline.exclusion import Exclusions, made_by, read_exclusions, write_exclusions

COUNTS = [13, 5, 9, 1, 17, 8, 11]  # 64 samples, labels pos % 7


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("excl"), COUNTS)


def test_round_trip_and_format(tmp_path):
    path = tmp_path / "x.txt"
    wanted = Exclusions(frozenset({"000000003", "a/b-c"}), frozenset({4, 0}))
    write_exclusions(path, wanted, header="launch.overlap threshold=0.4\ncheckpoint=runs/a")
    text = path.read_text()
    assert text.splitlines() == ["# launch.overlap threshold=0.4", "# checkpoint=runs/a",
                                 "class 0", "class 4", "sample 000000003", "sample a/b-c"]
    assert read_exclusions(path) == wanted
    (tmp_path / "y.txt").write_text("# c\n\nclass 2\n  sample k1  \n")
    assert read_exclusions(tmp_path / "y.txt") == Exclusions(frozenset({"k1"}), frozenset({2}))


def test_notes_after_entries_are_written_on_one_line_and_read_past(tmp_path):
    path = tmp_path / "x.txt"
    wanted = Exclusions(frozenset({"k#1"}), frozenset({3, 5}))
    write_exclusions(path, wanted, notes={"class 3": "person_03: lfw\nlfw.bin[2] 0.811"})
    assert path.read_text().splitlines() == ["class 3  # person_03: lfw lfw.bin[2] 0.811",
                                             "class 5", "sample k#1"]
    assert read_exclusions(path) == wanted  # a "#" inside a key is the key's
    (tmp_path / "y.txt").write_text("sample k2\t# why\nclass 2 #\n")
    assert read_exclusions(tmp_path / "y.txt") == Exclusions(frozenset({"k2"}), frozenset({2}))


def test_made_by_names_the_tool_its_settings_and_when(tmp_path):
    header = made_by("launch.clean", {"checkpoint": "runs/a", "threshold": "75 degrees"},
                     "3 of 40 samples listed")
    write_exclusions(tmp_path / "x.txt", Exclusions(samples=frozenset({"k"})), header=header)
    first, second, *_ = (tmp_path / "x.txt").read_text().splitlines()
    assert first == "# launch.clean checkpoint=runs/a threshold=75 degrees"
    assert re.fullmatch(r"# \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ: 3 of 40 samples listed", second)


@pytest.mark.parametrize("line", ["class -1", "class x", "class ²", "class " + "9" * 13,
                                  "sample", "sample a b", "key 3"])
def test_bad_line_names_file_and_line(tmp_path, line):
    path = tmp_path / "bad.txt"
    path.write_text(f"# header\nclass 1\n{line}\n")
    with pytest.raises(DataError, match=rf"bad\.txt:3: '{line}' is neither"):
        read_exclusions(path)
    with pytest.raises(DataError, match=r"nothing\.txt: cannot read"):
        read_exclusions(tmp_path / "nothing.txt")


def test_with_exclusions_maps_kept_positions_to_shard_positions():
    counts, excluded = [6, 4], [np.array([0, 2, 3]), np.array([], np.int64)]
    kept = [3, 4]  # shard 0 keeps positions 1, 4, 5
    pieces = epoch_plan.pieces_for_range(kept, [0, 1], 1, 5)
    mapped = epoch_plan.with_exclusions(pieces, counts, excluded)
    assert mapped == [epoch_plan.Piece(0, 4, 6), epoch_plan.Piece(1, 0, 2)]
    whole = epoch_plan.with_exclusions(epoch_plan.pieces_for_range(kept, [0], 0, 3), counts,
                                       excluded)
    assert whole == [epoch_plan.Piece(0, 1, 6, frozenset({2, 3}))]


@pytest.mark.parametrize("world_size,num_workers", [(1, 0), (2, 2), (3, 1)])
def test_excluded_samples_are_never_read_and_the_rest_once(shards, tmp_path, world_size,
                                                          num_workers):
    path = tmp_path / "x.txt"
    write_exclusions(path, Exclusions(frozenset({"000000001", "000000030"}), frozenset({3})))
    gone = {f"{p:09d}" for p in range(64) if p % 7 == 3} | {"000000001", "000000030"}
    seen = []
    for rank in range(world_size):
        loader = make_loader(shards, batch_size=2, rank=rank, world_size=world_size,
                             num_workers=num_workers, shuffle_buffer=5, with_keys=True,
                             exclude=path)
        assert loader.num_excluded == len(gone)
        assert len(loader) == (64 - len(gone)) // world_size // 2
        seen += epoch_keys(loader)
    assert len(seen) == len(set(seen)) and gone.isdisjoint(seen)
    assert len(seen) >= 64 - len(gone) - world_size * 2  # only the epoch's tail is dropped


def test_resume_with_exclusions_is_exact(shards, tmp_path):
    path = tmp_path / "x.txt"
    write_exclusions(path, Exclusions(classes=frozenset({0, 5})))
    kwargs = dict(batch_size=3, num_workers=2, shuffle_buffer=6, with_keys=True, seed=3,
                  exclude=path)
    full = epoch_keys(make_loader(shards, **kwargs))
    first = make_loader(shards, **kwargs)
    seen = []
    for step, (_, _, keys) in enumerate(first):
        seen += keys
        if step == 4:
            break
    resumed = make_loader(shards, **kwargs)
    resumed.load_state_dict(first.state_dict())
    assert sorted(seen + epoch_keys(resumed)) == sorted(full)
    # another list changes the plan: the resume is approximate, and says so by its key
    plain = make_loader(shards, **{**kwargs, "exclude": None})
    assert plain.plan_key() != first.plan_key()


def test_a_class_outside_the_folder_is_refused(shards, tmp_path):
    path = tmp_path / "other.txt"
    write_exclusions(path, Exclusions(classes=frozenset({7})))
    with pytest.raises(DataError, match=r"other\.txt: class 7 outside \[0, 7\)"):
        make_loader(shards, batch_size=2, exclude=path)
