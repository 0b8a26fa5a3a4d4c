"""Identities held twice (``offline.overlap.pairs``, ``launch.overlap --between``).

Fabricated centres first: 2,200 people, each a random unit direction in 64-d; a class's
centre is its person's direction plus Gaussian noise (mates meet at a cosine of about 0.74,
strangers near 0 with a spread of 1/8). Set A holds people 0-1,199 and people 0-29 a second
time (planted within A), set B people 1,000-2,199 (200 planted between A and B); A's people
100-499 are the held-out null (unmated). What is tested: the planted pairs are found, the
share of unmated searches that reach the threshold lies in the printed band (over 20 seeds,
as often as a 90 % band allows), and two ranks give one process's answer.

Then the command line on synthetic images with a fixed (untrained) embedding, as
``test_overlap.py`` makes it: two converted folders sharing six named people.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from spawn import run_ranks
from test_overlap import ColourFeatures

from data_pipeline.merge import merged_labels, read_merge
from data_pipeline.synthetic import SyntheticSource
from offline.overlap.calibration import calibrate
from offline.overlap.pairs import (
    CentreSet,
    find_pairs,
    gallery_note,
    nearest_centres,
    null_cosines,
)

DIM, NOISE = 64, 0.6
HELD = frozenset(range(100, 500))  # A's classes = people 0..1199 first: people 100..499
PLANTED = ({((0, p), (1, p - 1000)) for p in range(1000, 1200)}
           | {((0, p), (0, 1200 + p)) for p in range(30)})
INSIDE_AT_LEAST = 15  # of 20 seeds: P(Binomial(20, 0.9) < 15) = 0.011


def fabricated(seed: int) -> list[CentreSet]:
    rng = np.random.default_rng(seed)
    truth = rng.standard_normal((2200, DIM))
    truth /= np.linalg.norm(truth, axis=1, keepdims=True)

    def centres(people: np.ndarray) -> np.ndarray:
        x = truth[people] + rng.standard_normal((len(people), DIM)) * NOISE / np.sqrt(DIM)
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    a, b = np.r_[np.arange(1200), np.arange(30)], np.arange(1000, 2200)
    return [CentreSet("a", centres(a), np.full(len(a), 5.0)),
            CentreSet("b", centres(b), np.full(len(b), 5.0))]


def _search(sets, group=None):
    near = nearest_centres(sets, True, group)
    calibration = calibrate(*null_cosines(near, {0: HELD}, sets), 0.05, "fabricated")
    return near, calibration, find_pairs(near, calibration.threshold)


def test_planted_pairs_are_found_and_false_pairs_run_at_the_calibrated_rate():
    """Seed after seed: every planted pair listed; the unmated searches that were not null
    probes (A's people 500-999, B's 1,200-2,199) reach the threshold at a share inside the
    printed 90 % band as often as a 90 % band allows, and at the expected FPIR on average.

    The 20 seeds are 20 independent draws of the people and their centres, so a band that
    holds the rate with probability 0.9 holds it in Binomial(20, 0.9) of them: at least
    :data:`INSIDE_AT_LEAST` = 15 but with probability 0.011 (fewer says the band is too
    narrow; 18 here)."""
    inside, rates, expected = 0, [], []
    for seed in range(20):
        sets = fabricated(seed)
        near, calibration, pairs = _search(sets)
        assert PLANTED <= {(p.a, p.b) for p in pairs}, seed
        unmated = np.r_[near[0].scores[500:1000], near[1].scores[200:]]
        rate = float((unmated >= calibration.threshold).mean())
        inside += calibration.band[0] <= rate <= calibration.band[1]
        rates.append(rate)
        expected.append(calibration.expected_fpir)
        false = len(pairs) - len(PLANTED)  # each unmated search lists one pair at most
        assert false <= 2 * calibration.band[1] * (sum(map(len, (s.counts for s in sets))))
    assert inside >= INSIDE_AT_LEAST, f"the rate inside the band in {inside} of 20 seeds"
    assert np.mean(rates) == pytest.approx(np.mean(expected), abs=0.005)


def _ranks(rank, world, seed):
    from partial_fc.distributed import get_world_size

    assert get_world_size() == world
    near, calibration, pairs = _search(fabricated(seed))
    return near, calibration.threshold, pairs


def test_two_ranks_find_what_one_process_finds():
    near, calibration, pairs = _search(fabricated(0))
    for their_near, threshold, their_pairs in run_ranks(_ranks, world_size=2, args=(0,)):
        assert threshold == calibration.threshold and their_pairs == pairs
        for mine, one in zip(their_near, near, strict=True):
            np.testing.assert_array_equal(mine.scores, one.scores)
            np.testing.assert_array_equal(mine.set_index, one.set_index)
            np.testing.assert_array_equal(mine.label, one.label)


def test_a_search_over_more_centres_than_the_null_s_is_named():
    sets = fabricated(0)
    assert gallery_note(sets, True, {0: HELD}) is None  # within: all but one centre each
    note = gallery_note(sets, False, {0: HELD})  # A's probes search B (1,200), B's A (1,230)
    assert note.startswith("note: the null probes searched 1,200 centres; b (1,230) search")


@pytest.fixture(scope="module")
def two_sets(tmp_path_factory):
    """A: people person_00 ... person_19 (synthetic identities 0-19, images 0-7); B: images
    8-15 of person_14 ... person_19, and 14 people of another seed (stranger_00 ...)."""
    from launch.convert import main as convert

    root = tmp_path_factory.mktemp("two_sets")
    ours, theirs = SyntheticSource(20, 16, seed=0), SyntheticSource(14, 8, seed=1)
    for name, people in (("a", [(f"person_{c:02d}", ours, c * 16 + i)
                                for c in range(20) for i in range(8)]),
                         ("b", [(f"person_{c:02d}", ours, c * 16 + 8 + i)
                                for c in range(14, 20) for i in range(8)]
                          + [(f"stranger_{c:02d}", theirs, c * 8 + i)
                             for c in range(14) for i in range(8)])):
        for i, (person, source, index) in enumerate(people):
            folder = root / f"src_{name}" / person
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{i}.jpg").write_bytes(source.read(index)[0])
        assert convert(["imagefolder", str(root / f"src_{name}"), str(root / name),
                        "--samples-per-shard", "60"]) == 0
    held = root / "held.txt"
    held.write_text("".join(f"class {c}\n" for c in range(10)))  # A's person_00 ... 09
    return root / "a", root / "b", held


def test_cli_lists_the_shared_people_for_data_merge(two_sets, tmp_path, capsys,
                                                    monkeypatch):
    """The six people of both sets are listed by name beside the expected false count;
    the list reads back as data.merge reads it (30 + 20 classes, 34 people where only the
    six are joined), the JSON holds the calibration and the pairs, the page their images.
    An FPIR ten held-out identities cannot resolve, and a run that held none out: one
    line each."""
    from eval_helpers import make_run

    import launch.overlap.__main__ as overlap
    from launch.overlap import between as overlap_between

    monkeypatch.setattr(overlap_between, "load_backbone_or_exit", lambda p: ColourFeatures())
    a, b, held = two_sets
    out, js, page = tmp_path / "merge.txt", tmp_path / "pairs.json", tmp_path / "pairs.html"
    args = ["--checkpoint", str(make_run(tmp_path)), "--between", f"{a},{b}", "--out",
            str(out), "--device", "cpu"]
    assert overlap.main([*args, "--held-out", f"{held},", "--fpir", "0.1", "--json", str(js),
                         "--html", str(page)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("threshold ") and ("a search of the centres of the 10 "
                                                    "identities held out of training") in printed[0]
    shared = [f"0:{c} ~ 1:{c - 14}" for c in range(14, 20)]
    assert all(any(line.startswith(s) for line in printed) for s in shared)
    assert "person_15 (8 images) = person_15 (8 images)" in "\n".join(printed)
    summary = printed[-1]
    assert summary.endswith(f"train with data.merge={out})")
    assert " among 40 identities searched (expected false <= 3.6)" in summary  # 40 x 1/11

    merge = read_merge(out)
    assert merge.sets == (str(a), str(b))
    assert {((0, c), (1, c - 14)) for c in range(14, 20)} <= set(merge.pairs)
    labels = merged_labels(merge, [20, 20])
    assert labels.max() + 1 == 40 - len(merge.pairs)
    found = json.loads(js.read_text())
    assert found["calibration"]["identities"] == 10 and found["searches"] == 40
    assert found["expected_false"] == pytest.approx(40 / 11)
    first = found["pairs"][0]
    assert first["a"]["images"] == 8 and first["a"]["name"] == first["b"]["name"]
    assert page.read_text().count('<img src="data:image/jpeg;base64,') == 8 * len(merge.pairs)

    assert overlap.main([*args, "--held-out", f"{held},", "--fpir", "0.05"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("identities held out of training (--held-out "
                                      f"{held},), one search each: they resolve rates down "
                                      "to 1/11 = 0.091 only;") in err
    assert overlap.main(args) == 2  # the run (make_run's) held nothing out
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no data.exclude" in err
