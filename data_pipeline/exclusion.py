"""Exclusion lists: samples and identities a run must not train on.

One text format shared by the tools that find what to leave out (``launch.overlap``:
training identities that also appear in an evaluation set; the sub-center cleaning) and by
the loader that leaves it out (``data.exclude``)::

    # launch.overlap checkpoint=runs/r50 threshold=0.35 2026-11-25T18:00:00Z
    class 1042  # m.0abc12: lfw lfw.bin[233] 0.71
    sample 000123456

UTF-8; a line starting with ``#`` is a comment (the writing tool, its inputs and when), blank
lines are ignored, every other line is ``sample <key>`` (a webdataset ``__key__`` as
data_pipeline's writer stores it) or ``class <label>`` (a label in that data folder's own
class space, before any offset ``data.dirs`` applies), optionally followed by whitespace and a
``#`` note for the reader (the identity's name, what it matched).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from data_pipeline.door import is_index, read_text
from data_pipeline.errors import DataError
from data_pipeline.manifest import atomic_write_bytes
from data_pipeline.tar_reader import tar_samples

KINDS = ("sample", "class")
_NOTE = re.compile(r"\s+#.*$")  # an entry's trailing note (keys hold no whitespace)
MAX_BYTES = 256 << 20  # a list of 10^6 sample keys is ~40 MiB


@dataclass(frozen=True)
class Exclusions:
    """What to leave out of one data folder: sample keys and whole classes."""

    samples: frozenset[str] = frozenset()
    classes: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.samples or self.classes)

    def excludes(self, key: str, label: int) -> bool:
        """Whether the sample ``key`` of class ``label`` is left out."""
        return label in self.classes or key in self.samples


def read_exclusions(path: str | os.PathLike) -> Exclusions:
    """Parse an exclusion list; :class:`DataError` naming the file (and the line number of a
    bad line) when it is missing or malformed."""
    path = Path(path)
    text = read_text(path, "the exclusion list", limit=MAX_BYTES,
                     hint="; write one with python -m launch.overlap")
    samples, classes = set(), set()
    for number, line in enumerate(text.splitlines(), start=1):
        line = _NOTE.sub("", line.strip())
        if not line or line.startswith("#"):
            continue
        kind, _, value = line.partition(" ")
        value = value.strip()
        if kind == "sample" and value and " " not in value:
            samples.add(value)
        elif kind == "class" and is_index(value):
            classes.add(int(value))
        else:
            raise DataError(f"{path}:{number}: {line[:80]!r} is neither 'sample <key>' nor "
                            "'class <label>' (a label is 1-12 digits; comments start "
                            "with #)")
    return Exclusions(frozenset(samples), frozenset(classes))


def made_by(tool: str, settings: dict[str, object], summary: str) -> str:
    """A header for :func:`write_exclusions`: the tool with its settings on one line, then the
    time (UTC) and what it found, so that a list read months later says where it came from."""
    options = " ".join(f"{name}={value}" for name, value in settings.items())
    return f"{tool} {options}\n{datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}: {summary}"


def write_exclusions(path: str | os.PathLike, exclusions: Exclusions, header: str = "",
                     notes: Mapping[str, str] | None = None) -> None:
    """Write ``exclusions`` (classes, then samples, each sorted) atomically; every line of
    ``header`` becomes a ``#`` comment (say which tool, checkpoint, threshold and when), and
    ``notes[entry]`` (``entry``: ``"class 11"``, ``"sample KEY"``) a note after its entry."""
    for key in exclusions.samples:
        if not key or any(c.isspace() for c in key):
            raise ValueError(f"sample key {key!r}: empty or holds whitespace (not a "
                             "webdataset key)")
    if any(label < 0 for label in exclusions.classes):
        raise ValueError(f"class labels {sorted(exclusions.classes)[:3]}...: must be >= 0")
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    entries = [f"class {label}" for label in sorted(exclusions.classes)]
    entries += [f"sample {key}" for key in sorted(exclusions.samples)]
    notes = notes or {}
    lines += [f"{entry}  # {' '.join(notes[entry].split())}" if notes.get(entry) else entry
              for entry in entries]
    atomic_write_bytes(Path(path), ("\n".join(lines) + "\n").encode("utf-8"))


def excluded_positions(paths: list[Path], exclusions: Exclusions) -> list[np.ndarray]:
    """Per shard, the sorted positions (sample numbers inside the shard) that ``exclusions``
    leaves out. Reads every sample's key and ``.cls`` member, not its image: one pass over
    the tar headers when the loader starts. A sample without a readable label is excluded
    only by its key (the loader counts it as corrupt otherwise)."""
    out = []
    for path in paths:
        gone = []
        for position, sample in enumerate(tar_samples(path, exts=("cls",))):
            try:
                label = int(sample.get("cls", b"-1"))
            except ValueError:
                label = -1
            if exclusions.excludes(sample["__key__"], label):
                gone.append(position)
        out.append(np.asarray(gone, dtype=np.int64))
    return out
