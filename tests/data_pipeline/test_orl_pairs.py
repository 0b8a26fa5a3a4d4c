"""The ORL open-set verification .bin: pair structure, identities, determinism."""

from __future__ import annotations

import itertools

import pytest

from data_pipeline.codec import prepare_jpeg
from data_pipeline.errors import DataError
from data_pipeline.orl import find_orl_root
from data_pipeline.orl_pairs import orl_pairs, write_orl_verification_bin
from data_pipeline.verification_bin import read_bin


def test_orl_bin_pairs(tmp_path):
    path = write_orl_verification_bin(tmp_path / "orl.bin")
    images, issame = read_bin(path)
    assert len(issame) == 900 and sum(issame) == 450 and len(images) == 1800

    # Map each stored image back to its source file (same encoding as the shards).
    root = find_orl_root()
    source = {prepare_jpeg((root / f"s{i}" / f"{k}.pgm").read_bytes(), 112): (i, k)
              for i in range(31, 41) for k in range(1, 11)}
    assert len(source) == 100  # every image encodes to distinct bytes
    pairs = [(source[images[2 * p]], source[images[2 * p + 1]]) for p in range(900)]
    assert all((a[0] == b[0]) == same for (a, b), same in zip(pairs, issame, strict=True))
    genuine = {frozenset(p) for p, same in zip(pairs, issame, strict=True) if same}
    assert genuine == {frozenset(c) for i in range(31, 41)
                       for c in itertools.combinations([(i, k) for k in range(1, 11)], 2)}
    impostor = {frozenset(p) for p, same in zip(pairs, issame, strict=True) if not same}
    assert len(impostor) == 450  # no repeats
    # Folds of 90 consecutive pairs mix both kinds.
    assert all(0 < sum(issame[f * 90:(f + 1) * 90]) < 90 for f in range(10))


def test_pairs_are_seeded():
    assert orl_pairs(range(31, 41), 450, seed=0) == orl_pairs(range(31, 41), 450, seed=0)
    assert orl_pairs(range(31, 41), 450, seed=0) != orl_pairs(range(31, 41), 450, seed=1)
    with pytest.raises(DataError, match="num_impostor_pairs=4501"):
        orl_pairs(range(31, 41), 4501)
