"""Reading back what a W&B run recorded: the ``run-<id>.wandb`` file of each of its segments
(``RUN/wandb/offline-run-<time>-<id>/``, and ``run-<time>-<id>/`` online), which holds every
record the W&B service received, in order.

wandb 0.31 ships no reader for it. The file is a LevelDB-format log: a 7-byte header
(``:W&B``, 0xBEE1, version 0), then 32 KiB blocks of records, each a 7-byte header (the
CRC-32 of its type byte and data, the data's length, its type: whole, or the first, a middle
or the last piece of one split across blocks) and its data, a serialized
``wandb.proto.wandb_internal_pb2.Record``; fewer than 7 bytes left in a block are padding.
A service killed mid-write leaves a torn last record: reading stops before it.

The sink (:mod:`trainer.telemetry.sinks`) reads the earlier segments' files when a run
resumes, to send W&B the steps of metrics.jsonl a killed service never wrote.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 32 * 1024
FILE_HEADER = struct.Struct("<4sHB").pack(b":W&B", 0xBEE1, 0)
RECORD = struct.Struct("<IHB")  # CRC-32 of type + data, data length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class WandbLog:
    """One segment's record: the run ids its run records name, its history rows in order
    (``{key: value}``; nested keys joined by ``/``), and whether its end was torn."""

    run_ids: set[str] = field(default_factory=set)
    history: list[dict] = field(default_factory=list)
    torn: bool = False


def records(path: str | Path) -> Iterator[bytes]:
    """Every whole record's data in ``path``, in order; ends early at a torn record (set on
    the generator's return value: ``True`` when the file ended in one)."""
    data = Path(path).read_bytes()
    if not data.startswith(FILE_HEADER):
        raise ValueError(f"{path}: not a W&B run file (no ':W&B' header)")
    pos, parts = len(FILE_HEADER), []
    while pos < len(data):
        left = BLOCK - pos % BLOCK
        if left < RECORD.size:  # the block's padding
            pos += left
            continue
        if pos + RECORD.size > len(data):
            return True
        crc, length, kind = RECORD.unpack_from(data, pos)
        body = data[pos + RECORD.size:pos + RECORD.size + length]
        if len(body) < length or zlib.crc32(bytes([kind]) + body) != crc:
            return True
        pos += RECORD.size + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            parts = [body]
        elif kind == MIDDLE:
            parts.append(body)
        elif kind == LAST:
            yield b"".join([*parts, body])
            parts = []
    return bool(parts)


def read(path: str | Path) -> WandbLog:
    """``path``'s run ids and history rows (values decoded from their JSON)."""
    from wandb.proto.wandb_internal_pb2 import Record

    log, reader = WandbLog(), records(path)
    while True:
        try:
            body = next(reader)
        except StopIteration as end:
            log.torn = bool(end.value)
            return log
        record = Record.FromString(body)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            log.run_ids.add(record.run.run_id)
        elif kind == "history":
            log.history.append({"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                                for item in record.history.item})


def segments(wandb_dir: str | Path, run_id: str) -> list[Path]:
    """The run's ``.wandb`` files under ``RUN/wandb``, oldest segment first. Their folders
    are named by start time to the second; wandb names a second segment started in the
    same second ``...-<id>-1`` (then ``-2``, ...), so the order is (time, that suffix)."""
    folder = re.compile(rf"(?:offline-)?run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    found = []
    for path in Path(wandb_dir).glob(f"*run-*-{run_id}*/run-{run_id}.wandb"):
        named = folder.fullmatch(path.parent.name)
        if named:
            found.append(((named[1], int(named[2] or 0)), path))
    return [path for _, path in sorted(found)]
