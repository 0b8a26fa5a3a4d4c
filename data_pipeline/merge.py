"""Merge lists: classes of several data folders (or of one) that are one person.

The file ``launch.overlap --between`` writes and ``data.merge`` trains with; a person reads it,
strikes the pairs that are two people, and trains::

    # launch.overlap checkpoint=runs/finder threshold=0.7123 fpir=0.1
    # 2026-12-02T15:00:00Z: 11 pairs of 40 identities (expected false <= 3.6)
    set 0 /data/ms1mv3 93431 3f0c1d9a8b2e4c57
    set 1 /data/glint360k 360232 9a4e0b7c1d2f3e68
    pair 0:1042 1:77123 0.8731  # m.0abc12 (92 images) = 77123 (40 images)
    - pair 0:3 1:7 0.7222  # m.0x (10 images) = m.0y (12 images): struck, two people

UTF-8. ``#`` starts a comment (whole line, or after an entry: the note a person reads),
blank lines are ignored, and a line starting with ``-`` is *struck*: ignored, kept so the
list shows what a person decided. Every other line is ``set I FOLDER CLASSES DIGEST`` (set
``I`` is ``data.dirs[I]``, named so a list is not trained with its folders in another order;
``CLASSES`` and ``DIGEST`` are what the folder held when the list was made, :func:`content_of`,
so that a folder converted again, with the same class count but another label order, is
refused rather than merging the wrong people) or
``pair I:CLASS J:CLASS [COSINE]`` (a class in its folder's own labels, before the offset
``data.dirs`` applies; the cosine is what the search found, for the reader). Pairs chain:
``0:1 = 1:5`` and ``1:5 = 1:9`` make one class of three.

:func:`merged_labels` maps the side-by-side class space of ``data.dirs`` (folder ``i``'s
labels offset by the classes before it, data_pipeline.mixture) onto one label per person,
in order of each person's first class; :attr:`MergeList.digest` fingerprints the pairs and
folders as read (comments, notes and struck lines do not count), which a run records so that
a resume with an edited list is refused.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_pipeline.door import is_index, read_text
from data_pipeline.errors import DataError
from data_pipeline.manifest import Manifest, atomic_write_bytes, read_manifest
from data_pipeline.remote import is_url

Node = tuple[int, int]  # (set, class in that set's own labels)
MAX_BYTES = 256 << 20  # a list of 10^6 pairs is ~60 MiB; more is not a merge list
FORMAT = ("'set I FOLDER CLASSES DIGEST' or 'pair I:CLASS J:CLASS [COSINE]' (I, J, CLASS "
          "integers >= 0; '#' comments, '-' strikes a line)")
_HEX = frozenset("0123456789abcdef")
REGENERATE = "write the list again with python -m launch.overlap --between"


@dataclass(frozen=True)
class Content:
    """What a data folder held when a merge list was made of it: its class count and a
    digest of its identities (:func:`content_of`)."""

    classes: int
    digest: str

    def __str__(self) -> str:
        return f"{self.classes} {self.digest}"


@dataclass(frozen=True)
class MergeList:
    """The folders (``sets[i]``: the folder set ``i`` was read from) and the pairs of a
    merge list, struck lines left out; ``path`` names it in errors."""

    sets: tuple[str, ...]
    pairs: tuple[tuple[Node, Node], ...]
    path: str = ""
    contents: tuple[Content | None, ...] = ()  # per set; None on a list from before them

    @property
    def digest(self) -> str:
        """sha256 (16 hex digits) of the folders and the pairs as read, sorted."""
        text = "\n".join([f"set {i} {s}" for i, s in enumerate(self.sets)] + sorted(
            f"{a[0]}:{a[1]} {b[0]}:{b[1]}" for a, b in (sorted(p) for p in self.pairs)))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_merge(path: str | os.PathLike) -> MergeList:
    """Parse a merge list; DataError naming ``file:line`` (a bad line), or the file."""
    path = Path(path)
    text = read_text(path, "the merge list", limit=MAX_BYTES,
                     hint="; write one with python -m launch.overlap --between")
    sets: dict[int, str] = {}
    contents: dict[int, Content | None] = {}
    pairs: list[tuple[Node, Node]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        where = f"{path}:{number}"
        words = line.split()
        if words[0] == "set" and len(words) in (3, 5) and is_index(words[1]):
            index = int(words[1])
            if sets.setdefault(index, words[2]) != words[2]:
                raise DataError(f"{where}: set {index} named twice ({sets[index][:80]}, "
                                f"{words[2][:80]})")
            contents[index] = _content(words[3:], where)
        elif words[0] == "pair" and len(words) in (3, 4):
            pairs.append((_node(words[1], where), _node(words[2], where)))
            if len(words) == 4:
                _cosine(words[3], where)
        else:
            raise DataError(f"{where}: {line[:80]!r} is not {FORMAT}")
    if sorted(sets) != list(range(len(sets))):
        raise DataError(f"{path}: sets {sorted(sets)[:5]}: number them 0, 1, ... (one 'set I "
                        "FOLDER' line each)")
    for number, (a, b) in enumerate(pairs):
        for s, _ in (a, b):
            if s not in sets:
                raise DataError(f"{path}: pair {number + 1} names set {s}, which no "
                                f"'set {s} FOLDER' line names")
        if a == b:
            raise DataError(f"{path}: pair {number + 1} joins {a[0]}:{a[1]} with itself")
    return MergeList(tuple(sets[i] for i in range(len(sets))), tuple(pairs), str(path),
                     tuple(contents[i] for i in range(len(sets))))


def check_folders(merge: MergeList, folders: Sequence[str]) -> None:
    """DataError where set ``i`` of the list is not ``folders[i]`` (``data.dirs``), or the
    list names more sets than there are folders."""
    if len(merge.sets) > len(folders):
        raise DataError(f"{merge.path}: {len(merge.sets)} sets, but the run has "
                        f"{len(folders)} data folder(s)")
    for i, (named, folder) in enumerate(zip(merge.sets, folders, strict=False)):
        if not same_folder(named, folder):
            raise DataError(f"{merge.path}: set {i} is {named[:80]}, but data.dirs[{i}] is "
                            f"{folder} (list the folders in the order the list names them)")


def check_contents(merge: MergeList, folders: Sequence[str],
                   manifests: Sequence[Manifest]) -> None:
    """DataError (one line naming the set) where folder ``folders[i]`` (whose manifest, read
    already, is ``manifests[i]``) no longer holds what set ``i`` of the list was made from
    (:func:`content_of`), or the list records nothing of it: a list written before sets
    recorded their content is refused, naming the words that the folder's line needs if the
    folder is the one the pairs were found in."""
    for i, (recorded, folder, manifest) in enumerate(zip(merge.contents, folders, manifests,
                                                         strict=False)):
        now = content_of(folder, manifest)
        if recorded is None:
            raise DataError(f"{merge.path}: set {i} records no class count and digest of "
                            f"what it merged; {REGENERATE}, or, if {folder} is the folder "
                            f"the pairs were found in, end its set line with '{now}'")
        if recorded != now:
            raise DataError(f"{merge.path}: set {i}: {folder} holds {now.classes} classes "
                            f"(digest {now.digest}), the list was made from {recorded.classes} "
                            f"(digest {recorded.digest}): converted again since; "
                            f"{REGENERATE}")


def content_of(folder: str | os.PathLike, manifest: Manifest | None = None) -> Content:
    """Folder ``folder``'s class count (its manifest's: ``manifest`` where the caller has read
    it, else read here) and a digest (sha256, 16 hex digits) of its identities:
    ``identities.json``'s names in label order, or where a folder has none (converted before
    identity maps), what its manifest states of its samples (each shard's name, count, size
    and digest), which a conversion in another label order changes too."""
    from data_pipeline.identities import read_identities

    manifest = read_manifest(folder) if manifest is None else manifest
    identities = read_identities(folder, manifest)
    text = "\n".join(identities.names) if identities is not None else "\n".join(
        f"{s.name} {s.count} {s.bytes} {s.sha256}" for s in manifest.shards)
    return Content(manifest.num_classes, hashlib.sha256(text.encode()).hexdigest()[:16])


def same_folder(a: str, b: str) -> bool:
    """Whether two names of a shard folder (paths or URLs) name the same one."""
    if is_url(a) or is_url(b):
        return a.rstrip("/") == b.rstrip("/")
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, ValueError):  # a name no file system holds (a NUL byte, a loop)
        return a == b


def _node(word: str, where: str) -> Node:
    s, _, c = word.partition(":")
    if not (is_index(s) and is_index(c)):
        raise DataError(f"{where}: {word[:40]!r} is not SET:CLASS (two integers >= 0)")
    return int(s), int(c)


def _content(words: list[str], where: str) -> Content | None:
    """A set line's ``CLASSES DIGEST``; None where the line has neither (an older list)."""
    if not words:
        return None
    classes, digest = words
    if not (is_index(classes) and len(digest) == 16 and set(digest) <= _HEX):
        raise DataError(f"{where}: {classes[:20]!r} {digest[:20]!r} is not CLASSES DIGEST (an "
                        "integer and 16 hex digits)")
    return Content(int(classes), digest)


def _cosine(word: str, where: str) -> None:
    try:
        value = float(word)
    except ValueError:
        value = float("nan")
    if not -1 <= value <= 1:
        raise DataError(f"{where}: {word[:40]!r} is not a cosine in [-1, 1]")


def write_merge(path: str | os.PathLike, sets: Sequence[str], contents: Sequence[Content],
                pairs: Sequence[tuple[Node, Node, float, str]], header: str = "") -> None:
    """Write a merge list atomically: ``header``'s lines as comments, the sets with what each
    holds (``contents[i]``, :func:`content_of`), then one ``pair`` line per ``(a, b, cosine,
    note)``, in the order given."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines += [f"set {i} {s} {c}" for i, (s, c) in enumerate(zip(sets, contents, strict=True))]
    lines += [f"pair {a[0]}:{a[1]} {b[0]}:{b[1]} {cos:.4f}" + (f"  # {note}" if note else "")
              for a, b, cos, note in pairs]
    atomic_write_bytes(Path(path), ("\n".join(lines) + "\n").encode("utf-8"))


def merged_count(merge: MergeList, num_classes: Sequence[int]) -> int:
    """How many people the side-by-side classes of ``num_classes`` are once the pairs'
    classes are one, counted over the classes the pairs name alone: nothing is sized by
    the class counts the manifests state, which are bounded after this (the head's memory
    check, trainer.config.head_memory) and before :func:`merged_labels` makes its map.
    DataError where a pair names a set or class outside ``num_classes``."""
    return sum(num_classes) - len(_joined(merge, num_classes))


def merged_labels(merge: MergeList, num_classes: Sequence[int]) -> np.ndarray:
    """``[sum(num_classes)]`` int64: the label of each class of the side-by-side space (set
    ``i``'s class ``c`` at ``sum(num_classes[:i]) + c``) once the pairs' classes are one;
    labels ``0 .. people - 1`` in order of each person's first class. DataError where a pair
    names a set or class outside ``num_classes``. Sized by the class counts: call it once
    they are bounded (:func:`merged_count` is what a check needs)."""
    joined = _joined(merge, num_classes)
    person = np.arange(sum(num_classes))
    for node, first in joined.items():
        person[node] = first
    return np.unique(person, return_inverse=True)[1].astype(np.int64)  # roots sort by first


def _joined(merge: MergeList, num_classes: Sequence[int]) -> dict[int, int]:
    """Each class of the side-by-side space that a pair joins to an earlier one, mapped to
    its person's first class (union-find over the classes the pairs name)."""
    offsets = [0, *itertools.accumulate(num_classes)]
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.get(x, x) != x:
            parent[x] = parent.get(parent[x], parent[x])
            x = parent[x]
        return x

    for a, b in merge.pairs:
        for s, c in (a, b):
            if s >= len(num_classes) or c >= num_classes[s]:
                have = (f"set {s} has {num_classes[s]} classes" if s < len(num_classes)
                        else f"the run has {len(num_classes)} data folder(s)")
                raise DataError(f"{merge.path}: pair {a[0]}:{a[1]} {b[0]}:{b[1]}: {have}")
        ra, rb = root(offsets[a[0]] + a[1]), root(offsets[b[0]] + b[1])
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)  # a person's root: its first class
    return {x: root(x) for x in parent if root(x) != x}
