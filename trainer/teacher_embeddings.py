"""A teacher's embeddings of every training sample, stored beside the shards' layout so that
offline distillation (``distill.embeddings``) reads them instead of running the teacher.

At Partial-FC scale an online teacher costs a second forward pass on every rank every step;
computed once, the teacher's output is one more field per sample. Layout of ``OUT``::

    OUT/embeddings.json        what was embedded: the teacher, the width, the views, the data
    OUT/<shard stem>.npz       per data shard: ``keys`` (the samples' ``__key__``, in shard
                               order), ``embeddings`` float32 [n, views, D], ``skipped`` (the
                               keys of undecodable samples, which the loader drops too)

``views`` is ``["plain"]`` or ``["plain", "flipped"]``: the teacher's embedding of the image
and of its mirror, the two inputs a flipping run's student can see. The images go through
the loader's decode and ``normalize_images`` (the flip, too, mirrors the uint8 rows as the
engine does), so a stored embedding is the one an online teacher computes on the same batch,
to float rounding. Each shard's file is written atomically when complete: a rerun (any
number of ranks) skips the shards already written, which makes the job resumable.

This module is the layout and its reader (what a run needs); ``offline.embedding_sets``
writes and verifies such a folder for ``launch.embed``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from data_pipeline.errors import DataError

INDEX = "embeddings.json"
FORMAT_VERSION = 1


def shard_file(out: Path, shard_name: str) -> Path:
    """Where the embeddings of the data shard ``shard_name`` are stored under ``out``."""
    return out / (Path(shard_name).name.removesuffix(".tar") + ".npz")


def read_index(out: str | Path) -> dict:
    """``OUT/embeddings.json``; DataError (one line) when there is none."""
    path = Path(out) / INDEX
    if not path.is_file():
        raise DataError(f"{path}: missing (not a folder python -m launch.embed wrote)")
    return json.loads(path.read_text())


class TeacherEmbeddings:
    """The stored embeddings, all in memory (``N x views x D`` float32: 2 GB for a million
    samples of two 512-d views), looked up by sample key."""

    def __init__(self, out: str | Path) -> None:
        out = Path(out)
        self.index = read_index(out)
        self.flipped = len(self.index["views"]) == 2
        keys, parts = [], []
        for name, _ in self.index["data"]["shards"]:
            path = shard_file(out, name)
            if not path.is_file():
                raise DataError(f"{path}: missing (python -m launch.embed did not finish; "
                                "run it again)")
            with np.load(path, allow_pickle=False) as stored:
                keys.extend(stored["keys"].tolist())
                parts.append(stored["embeddings"])
        self.rows = {key: i for i, key in enumerate(keys)}
        self.embeddings = torch.from_numpy(np.concatenate(parts))
        self.where = out

    @property
    def embedding_size(self) -> int:
        return int(self.index["embedding_size"])

    def lookup(self, keys: Sequence[str], flips: torch.Tensor | None) -> torch.Tensor:
        """``[n, D]``: each key's plain view, or its flipped one where ``flips`` is set."""
        try:
            rows = torch.tensor([self.rows[k] for k in keys])
        except KeyError as missing:
            raise DataError(f"{self.where}: no teacher embedding of sample {missing} "
                            "(python -m launch.embed --verify names what is off)") from None
        if flips is None or not self.flipped:
            if flips is not None and bool(flips.any()):
                raise DataError(f"{self.where}: embedded without flips, but the run flips "
                                "(data.flip=false, or embed again without --no-flip)")
            return self.embeddings[rows, 0]
        return self.embeddings[rows, flips.to(torch.int64).cpu()]
