"""A checkpoint's meta.json as typed values: what the training loop records beside the
engine's state (:class:`RunRecord`) and what a checkpoint folder says about itself
(:class:`CheckpointMeta`)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from data_pipeline.errors import DataError
from data_pipeline.json_file import read_json


@dataclass(frozen=True)
class RunRecord:
    """The loop's part of a checkpoint: this rank's loader position (``EpochBatches``'
    ``state_dict``, JSON-able), the run's name and config (for ``resume_drift``) and its
    counters of skipped steps and samples."""

    loader: dict | None = None
    name: str = ""
    config: dict | None = None
    bad_steps: int = 0
    skipped_steps: int = 0
    skipped_samples: int = 0


@dataclass(frozen=True)
class CheckpointMeta:
    """meta.json: the step, the world size it was saved on, every rank's loader position
    (``loaders``, in rank order), the :class:`RunRecord`'s other fields, the row-sharded
    entries (``rows``) and the SHA-256 of every file (``files``)."""

    step: int
    world_size: int
    loaders: list
    rows: list[str]
    files: dict[str, str]
    name: str = ""
    config: dict | None = None
    bad_steps: int = 0
    skipped_steps: int = 0
    skipped_samples: int = 0

    @classmethod
    def of(cls, record: RunRecord, **saved) -> CheckpointMeta:
        """``record`` with what the save adds (``step``, ``world_size``, ``loaders``,
        ``rows``, ``files``)."""
        fields_ = asdict(record)
        fields_.pop("loader")
        return cls(**fields_, **saved)

    def to_json(self) -> str:
        """meta.json's text (its ``loader`` key holds the per-rank list)."""
        out = asdict(self)
        out["loader"] = out.pop("loaders")
        return json.dumps(out, indent=1)

    @classmethod
    def from_json(cls, data: dict) -> CheckpointMeta:
        """From meta.json's parsed object; keys this version does not know are ignored.
        TypeError naming the first key whose value is not of its field's JSON type."""
        known = {f.name for f in fields(cls)} - {"loaders"}
        values = {k: v for k, v in data.items() if k in known}
        values["loaders"] = data.get("loader") or []
        for key, value in values.items():
            if not isinstance(value, JSON_TYPES[key]):
                raise TypeError(f"{key!r} is {type(value).__name__} {str(value)[:40]!r}")
        return cls(**values)


JSON_TYPES = {"step": int, "world_size": int, "loaders": list, "rows": list, "files": dict,
              "name": str, "config": dict | None, "bad_steps": int, "skipped_steps": int,
              "skipped_samples": int}  # CheckpointMeta's fields as meta.json holds them


def checkpoint_step(folder: Path) -> int:
    """The step checkpoint ``folder`` holds: its meta.json's ``step``, else the number in its
    ``step-<n>`` tag (a ``final`` folder always has meta.json), else 0."""
    try:
        step = read_json(folder / "meta.json", "checkpoint meta").get("step")
    except DataError:
        step = None
    if isinstance(step, int):
        return step
    match = re.fullmatch(r"step-(\d+)", folder.name)
    return int(match.group(1)) if match else 0
