"""The two training sets ``bench/merge_effect.py`` trains on, written with the truth of who is
whom, so that a merge list can be checked pair by pair (as a person reviewing it would).

Two settings, each a :class:`SetPair`:

- :func:`synthetic_sets`: ``data_pipeline.synthetic``'s identities (one person = one class
  canvas, four images each) at scale. People ``[0, shared)`` are in both sets, images 0-1 in A
  and 2-3 in B (half to each, as the ORL split); each set's own people have all four images;
  the first ``within`` own people of each set are held under two names (images 0-1 and 2-3:
  one person under two names, what ``launch.overlap --within`` looks for). Class numbers are
  a seeded shuffle of each set's names, so a pair's labels say nothing. The test people are
  further numbers no set holds; the null (``--held-out ,LIST``) is B's own people that the
  finder, trained on A alone, never saw, none of them held twice.
- :func:`orl_sets`: ``data_pipeline.orl.write_orl_shared_sets`` (A = s1-s20, B = s11-s30, the
  ten shared people split 1-5 / 6-10), the null B's s21-s30, tested on s31-s40
  (``bench/orl_margins.all_pairs_images``).

``truth`` maps every class node ``(set, class)`` to its person, so a pair is true iff both
nodes are one person (:func:`true_pairs`, :func:`review`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_pipeline.codec import decode_image, resolve_decoder
from data_pipeline.identities import Identities
from data_pipeline.merge import content_of, write_merge
from data_pipeline.orl import write_orl_shared_sets
from data_pipeline.synthetic import SIZE, SyntheticSource
from data_pipeline.writer import write_dataset

Node = tuple[int, int]  # (set, class in that set's own labels)
IMAGES = 4  # images per synthetic person
_PAIR = re.compile(r"^pair (\d+):(\d+) (\d+):(\d+)\b")


@dataclass(frozen=True)
class SetPair:
    """Two training folders, the finder's null for B, the truth and the test images
    (uint8 ``[N, 3, 112, 112]`` of people no set holds, ``test_ids [N]`` their people)."""

    a: Path
    b: Path
    null: Path
    truth: dict[Node, int]
    test_images: np.ndarray
    test_ids: np.ndarray


class _People(SyntheticSource):
    """One set: ``entries[i] = (label, person, image)`` drawn from the synthetic people."""

    def __init__(self, entries: list[tuple[int, int, int]], names: list[str], seed: int,
                 noise: float):
        super().__init__(1 + max(person for _, person, _ in entries), IMAGES, seed, noise)
        self.entries, self.names = entries, names
        self.num_classes = len(names)

    def __len__(self) -> int:
        return len(self.entries)

    def describe(self) -> dict:
        return {"type": "synthetic-people", "classes": len(self.names),
                "images": len(self.entries), "seed": self.seed, "noise": self.noise}

    def identity_map(self) -> Identities:
        return Identities(tuple(self.names), "bench/merge_sets: p<person>, a second name b")

    def read(self, index: int) -> tuple[bytes, int, str]:
        label, person, image = self.entries[index]
        data, _, _ = super().read(person * IMAGES + image)
        return data, label, f"{person}/{image}"


def _write_set(out: Path, held: list[tuple[str, int, tuple[int, ...]]], seed: int,
               noise: float, set_index: int, truth: dict[Node, int]) -> dict[str, int]:
    """Write one set of ``(name, person, images)``, labels a seeded shuffle; name -> label."""
    order = np.random.default_rng([seed, set_index]).permutation(len(held))
    label = {held[i][0]: n for n, i in enumerate(order)}
    entries = [(label[name], person, image) for name, person, images in held
               for image in images]
    names = sorted(label, key=label.get)
    for name, person, _ in held:
        truth[(set_index, label[name])] = person
    if not (out / "manifest.json").is_file():
        write_dataset(_People(entries, names, seed, noise), out, size=SIZE, shuffle_seed=seed)
    return label


def synthetic_sets(work: Path, people: int, shared: int, within: int, test: int, null: int,
                   noise: float, seed: int = 0) -> SetPair:
    """A and B with ``people`` people each, ``shared`` of them in both, ``within`` of each
    set's own held twice; ``test`` test people; ``null`` of B's own the finder's null;
    ``noise`` the pixel noise's sigma. Written under ``work``, in a folder named by them."""
    own = people - shared
    if not 0 < shared < people or within + null > own or test < 2:
        raise ValueError(f"people={people} shared={shared} within={within} null={null} "
                         f"test={test}: need 0 < shared < people, within + null <= "
                         "people - shared, test >= 2")
    work = work / f"synthetic-{people}-{shared}-{within}-{test}-noise{noise:g}"
    truth: dict[Node, int] = {}
    labels = []
    for index, first in enumerate((shared, shared + own)):
        half = (0, 1) if index == 0 else (2, 3)
        held = [(f"p{p}", p, half) for p in range(shared)]
        for p in range(first, first + own):
            twice = p < first + within
            held.append((f"p{p}", p, (0, 1) if twice else tuple(range(IMAGES))))
            if twice:
                held.append((f"p{p}b", p, (2, 3)))
        labels.append(_write_set(work / "ab"[index], held, seed, noise, index, truth))
    b_own = range(shared + own + within, shared + 2 * own)
    null_list = work / "null_b.txt"
    null_list.write_text("".join(f"class {labels[1][f'p{p}']}\n" for p in b_own[:null]))
    first_test = shared + 2 * own
    source = SyntheticSource(first_test + test, IMAGES, seed, noise)
    decoder = resolve_decoder("auto")
    items = range(first_test * IMAGES, (first_test + test) * IMAGES)
    images = np.stack([decode_image(source.read(i)[0], SIZE, decoder).transpose(2, 0, 1)
                       for i in items])
    ids = np.array([i // IMAGES for i in items])
    return SetPair(work / "a", work / "b", null_list, truth, images, ids)


def orl_sets(work: Path) -> SetPair:
    """docs/data.md's ORL split; the null B's s21-s30; tested on s31-s40's 100 images."""
    from orl_margins import all_pairs_images  # bench/: the held-out images, encoded as the .bin

    a, b = work / "orl_a", work / "orl_b"
    if not (b / "manifest.json").is_file():
        write_orl_shared_sets(a, b)
    names_a = sorted(f"s{i}" for i in range(1, 21))
    names_b = sorted(f"s{i}" for i in range(11, 31))
    truth = {(0, n): int(name[1:]) for n, name in enumerate(names_a)}
    truth |= {(1, n): int(name[1:]) for n, name in enumerate(names_b)}
    null = work / "orl_null_b.txt"
    null.write_text("".join(f"class {names_b.index(f's{i}')}\n" for i in range(21, 31)))
    images, faces, _ = all_pairs_images()
    return SetPair(a, b, null, truth, images, np.array([person for person, _ in faces]))


def true_pairs(truth: dict[Node, int]) -> list[tuple[Node, Node]]:
    """Every pair of classes that is one person (each person's classes chained to its first)."""
    first: dict[int, Node] = {}
    pairs = []
    for node, person in sorted(truth.items()):
        if person in first:
            pairs.append((first[person], node))
        else:
            first.setdefault(person, node)
    return pairs


def write_true_list(path: Path, sets: SetPair) -> int:
    """The merge list of every true pair (the upper bound a perfect finder gives)."""
    pairs = true_pairs(sets.truth)
    folders = [str(sets.a), str(sets.b)]
    write_merge(path, folders, [content_of(f) for f in folders],
                [(a, b, 1.0, "one person") for a, b in pairs], f"the truth: {len(pairs)} pairs")
    return len(pairs)


def review(found: Path, out: Path, truth: dict[Node, int]) -> dict[str, int]:
    """Strike (``- ``) every listed pair of two people, as a person looking at the pairs would;
    write the reviewed list to ``out``. Counts: listed, true (across sets, within one) and
    false pairs, and the true pairs there are."""
    lines, counts = [], {"listed": 0, "true_across": 0, "true_within": 0, "false": 0}
    for line in found.read_text().splitlines():
        match = _PAIR.match(line)
        if match:
            i, c, j, d = map(int, match.groups())
            counts["listed"] += 1
            if truth[(i, c)] != truth[(j, d)]:
                counts["false"] += 1
                line = f"- {line}"
            else:
                counts["true_across" if i != j else "true_within"] += 1
        lines.append(line)
    out.write_text("\n".join(lines) + "\n")
    every = true_pairs(truth)
    counts["there_across"] = sum(a[0] != b[0] for a, b in every)
    counts["there_within"] = len(every) - counts["there_across"]
    return counts
