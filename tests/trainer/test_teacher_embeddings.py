"""The stored teacher embeddings' reader: exact lookups by key and flip bit, read in place.

What a rank maps and holds is measured from the process's own ``/proc/self`` (its memory
maps and anonymous memory), not from the reader's account of itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from launch_helpers import ROOT

from data_pipeline.errors import DataError
from trainer.teacher_embeddings import (
    FORMAT_VERSION,
    INDEX,
    TeacherEmbeddings,
    shard_file,
    write_shard,
)


def _stored(out: Path, shards: int, rows: int, width: int, views: int = 2) -> dict[str, tuple]:
    """A stored set of ``shards`` files of ``rows`` samples; ``{key: (shard, row)}`` and the
    embeddings (``embeddings[shard]``) written."""
    rng = np.random.default_rng(0)
    names = [f"shard-{s:06d}.tar" for s in range(shards)]
    out.mkdir()
    (out / INDEX).write_text(json.dumps({
        "format_version": FORMAT_VERSION, "teacher": "t", "embedding_size": width,
        "views": ["plain", "flipped"][:views],
        "data": {"num_samples": shards * rows, "shards": [[n, rows] for n in names]}}))
    written = []
    for s, name in enumerate(names):
        emb = rng.standard_normal((rows, views, width)).astype(np.float32)
        write_shard(shard_file(out, name), [f"{s}/{r}" for r in range(rows)], [], emb)
        written.append(emb)
    return written


def test_lookup_returns_the_stored_rows_by_key_and_flip_bit(tmp_path):
    written = _stored(tmp_path / "emb", shards=3, rows=5, width=4)
    table = TeacherEmbeddings(tmp_path / "emb")
    keys = ["2/4", "0/0", "1/3", "0/0"]
    flips = torch.tensor([True, False, True, True])
    got = table.lookup(keys, flips)
    want = [written[2][4, 1], written[0][0, 0], written[1][3, 1], written[0][0, 1]]
    assert torch.equal(got, torch.from_numpy(np.stack(want)))
    assert torch.equal(table.lookup(keys, None)[2], torch.from_numpy(written[1][3, 0]))
    assert table.lookup([], None).shape == (0, 4)
    assert len(table) == 15 and "1/3" in table and "1/5" not in table
    with pytest.raises(DataError) as caught:
        table.lookup(["0/1", "9/9"], None)
    assert "'9/9'" in str(caught.value) and len(str(caught.value).splitlines()) == 1


def test_a_set_embedded_without_flips_refuses_a_flipping_run(tmp_path):
    _stored(tmp_path / "emb", shards=1, rows=2, width=3, views=1)
    table = TeacherEmbeddings(tmp_path / "emb")
    assert table.lookup(["0/1"], torch.tensor([False])).shape == (1, 3)
    with pytest.raises(DataError, match="without flips"):
        table.lookup(["0/1"], torch.tensor([True]))


def test_a_compressed_shard_file_is_refused_in_one_line(tmp_path):
    _stored(tmp_path / "emb", shards=1, rows=2, width=3)
    path = shard_file(tmp_path / "emb", "shard-000000.tar")
    np.savez_compressed(path, keys=np.array(["0/0", "0/1"]), skipped=np.array([], str),
                        embeddings=np.zeros((2, 2, 3), np.float32))
    with pytest.raises(DataError, match="compressed") as caught:
        TeacherEmbeddings(tmp_path / "emb").lookup(["0/0"], None)
    assert str(path) in str(caught.value)


PROBE = """
import json, sys
from pathlib import Path
import torch
from trainer.teacher_embeddings import TeacherEmbeddings

def anon():
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(x for x in lines if x.startswith("RssAnon:")).split()[1]) * 1024

def mapped():
    files = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(".npz"):
            files.add(Path(line.split()[-1]).name)
    return sorted(files)

before = anon()
table = TeacherEmbeddings(sys.argv[1], max_open=2)
after_index = mapped()
keys = [f"{s}/{r}" for s in (0, 3) for r in (7, 300, 650, 1023)]
got = table.lookup(keys, torch.tensor([False, True] * 4))
after_lookup = mapped()
table.lookup(["5/1"], None)
print(json.dumps({"grown": anon() - before, "index": after_index, "lookup": after_lookup,
                  "third": mapped(), "row": got[1].tolist(),
                  "reported": [p.name for p in table.mapped_files()]}))
"""


def test_a_rank_maps_only_its_samples_shards_and_never_loads_the_set(tmp_path):
    """8 shards of 1 024 samples x 2 views x 512-d (4 MiB each, 32 MiB in all). A process
    that asks for 8 samples of 2 shards maps those 2 files, never more than ``max_open``, and
    its own (anonymous) memory grows by far less than the set: the reader that held it all
    grew by 32 MiB or more. Measured from the process's own ``/proc/self`` (a fresh one:
    this one's allocator keeps what writing the set freed). Which pages of a mapped file are
    resident is the kernel's choice (it maps page-cache folios of up to 2 MiB on a fault)."""
    out = tmp_path / "emb"
    written = _stored(out, shards=8, rows=1024, width=512)
    probe = subprocess.run([sys.executable, "-c", PROBE, str(out)], capture_output=True,
                           text=True, cwd=ROOT, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    seen = json.loads(probe.stdout)
    assert seen["index"] == []  # the key index is built without mapping a file
    assert seen["lookup"] == ["shard-000000.npz", "shard-000003.npz"]
    assert seen["third"] == ["shard-000003.npz", "shard-000005.npz"] == sorted(seen["reported"])
    assert seen["row"] == written[0][300, 1].tolist()
    assert seen["grown"] < 8 * 2**20, seen["grown"]
