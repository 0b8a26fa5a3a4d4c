"""A batch source's place in its epochs as typed values: the plan that fixes an epoch's
sample order (:class:`ShardPlan`, :class:`SyntheticPlan`, :class:`ImportedPlan`, compared by
equality) and the position a checkpoint carries (:class:`ShardPosition`,
:class:`SyntheticPosition`, :class:`MixturePosition`, and a ``train.global_batch`` loader's
:class:`StreamsPosition`, one of those per micro-batch stream).

``to_dict()`` / ``from_dict()`` are the checkpoint boundary: the stored form is a plain
JSON-able dict, the same keys as the loaders have always written (a shard plan without an
exclusion list has no ``"excluded"`` key). A dict that does not parse raises one line,
``ValueError("loader state_dict: malformed (...)")``.
"""

from __future__ import annotations

import contextlib
import typing
from dataclasses import asdict, dataclass
from typing import ClassVar

from data_pipeline import epoch_plan


@contextlib.contextmanager
def _parsing(what: str = "malformed"):
    """Turn a missing key or a wrong value into the one-line ValueError."""
    try:
        yield
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"loader state_dict: {what} ({type(exc).__name__}: {exc})") from exc


@dataclass(frozen=True)
class ShardPlan:
    """What fixes a shard loader's epoch order (data_pipeline.loader). ``num_workers`` is
    the number of sample streams (at least 1); ``excluded`` fingerprints the exclusion
    list ("" when none)."""

    seed: int
    world_size: int
    num_workers: int
    batch_size: int
    num_samples: int
    shuffle: bool
    shuffle_buffer: int
    excluded: str = ""

    source: ClassVar[str | None] = None

    @property
    def batches_per_rank(self) -> int:
        return epoch_plan.batches_per_rank(self.num_samples, self.world_size, self.batch_size)

    def to_dict(self) -> dict:
        out = asdict(self)
        if not self.excluded:
            del out["excluded"]
        return out


@dataclass(frozen=True)
class SyntheticPlan:
    """What fixes which samples global batch b of a ``SyntheticStream`` holds."""

    seed: int
    num_samples: int
    num_classes: int
    global_batch: int  # batch_size * world_size

    source: ClassVar[str | None] = "synthetic"

    @property
    def batches_per_rank(self) -> int:
        return self.num_samples // max(1, self.global_batch)

    def to_dict(self) -> dict:
        return {"source": self.source, **asdict(self)}


@dataclass(frozen=True)
class ImportedPlan:
    """The plan of a position converted from an arcface_torch run (offline.insightface): it
    matches no loader's, so the position resumes at its epoch's start on any data and ranks."""

    num_samples: int = 0
    world_size: int = 1
    batch_size: int = 1

    source: ClassVar[str | None] = "arcface_torch"

    @property
    def batches_per_rank(self) -> int:
        return epoch_plan.batches_per_rank(self.num_samples, self.world_size, self.batch_size)

    def to_dict(self) -> dict:
        return {"source": self.source, **asdict(self)}


Plan = ShardPlan | SyntheticPlan | ImportedPlan
_PLANS = {kind.source: kind for kind in typing.get_args(Plan)}


def plan_from_dict(data) -> Plan:
    """The plan stored as ``data`` (its ``"source"`` picks the kind; none: a shard plan).
    KeyError, TypeError or ValueError when it is none of them."""
    data = dict(data)
    kind = _PLANS[data.pop("source", None)]
    types = typing.get_type_hints(kind)
    for key, value in data.items():
        if key in types and not isinstance(value, types[key]):
            raise TypeError(f"plan {key}={value!r} is not {types[key].__name__}")
    return kind(**data)


@dataclass(frozen=True)
class ShardPosition:
    """A shard loader's position: the epoch, the batches of it handed out, the rank that
    saved it, each worker's stream position and the epoch's corrupt (``num_skipped``) and
    repeated (``num_padded``) samples so far, under ``plan``."""

    epoch: int
    batches: int
    rank: int
    worker_positions: tuple[int, ...]
    num_skipped: int
    num_padded: int
    plan: Plan

    def to_dict(self) -> dict:
        return {**asdict(self), "worker_positions": list(self.worker_positions),
                "plan": self.plan.to_dict()}

    @classmethod
    def from_dict(cls, state: dict) -> ShardPosition:
        with _parsing():
            epoch, batches, rank, plan = _head(state)
            return cls(epoch, batches, rank, tuple(int(p) for p in state["worker_positions"]),
                       int(state.get("num_skipped", 0)), int(state.get("num_padded", 0)), plan)


@dataclass(frozen=True)
class SyntheticPosition:
    """A ``SyntheticStream``'s position: the epoch and its batches handed out under
    ``plan`` (read from any loader's state: another plan resumes approximately)."""

    epoch: int
    batches: int
    rank: int
    plan: Plan

    def to_dict(self) -> dict:
        return {**asdict(self), "plan": self.plan.to_dict()}

    @classmethod
    def from_dict(cls, state: dict) -> SyntheticPosition:
        with _parsing():
            return cls(*_head(state))


def _head(state: dict) -> tuple[int, int, int, Plan]:
    """The epoch, batches, rank and plan every single-source state holds."""
    return (int(state["epoch"]), int(state["batches"]), int(state["rank"]),
            plan_from_dict(state["plan"]))


@dataclass(frozen=True)
class MixturePosition:
    """A ``data.dirs`` mixture's position: its epoch and batches, and every set's own."""

    epoch: int
    batches: int
    sets: tuple[ShardPosition, ...]

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "batches": self.batches,
                "sets": [s.to_dict() for s in self.sets]}

    @classmethod
    def from_dict(cls, state: dict) -> MixturePosition:
        with _parsing("not a data.dirs loader's"):
            sets = list(state["sets"])
            epoch, batches = int(state["epoch"]), int(state["batches"])
        return cls(epoch, batches, tuple(ShardPosition.from_dict(s) for s in sets))


SourcePosition = ShardPosition | SyntheticPosition | MixturePosition


def source_position(state: dict) -> SourcePosition:
    """A single source's stored position as its typed value, its kind read from its keys
    (a mixture's ``sets``, a shard loader's ``worker_positions``, else synthetic)."""
    if "sets" in state:
        return MixturePosition.from_dict(state)
    if "worker_positions" in state:
        return ShardPosition.from_dict(state)
    return SyntheticPosition.from_dict(state)


@dataclass(frozen=True)
class StreamsPosition:
    """A ``train.global_batch`` loader's position (data_pipeline.micro_batches): each of this
    rank's micro-batch streams' own, by stream number ``j`` (micro-batch ``j`` of each step)."""

    streams: tuple[tuple[int, SourcePosition], ...]

    def to_dict(self) -> dict:
        return {"streams": [{"stream": j, "position": p.to_dict()} for j, p in self.streams]}

    @classmethod
    def from_dict(cls, state: dict) -> StreamsPosition:
        with _parsing("not a train.global_batch loader's"):
            streams = [(int(s["stream"]), dict(s["position"])) for s in state["streams"]]
        return cls(tuple((j, source_position(p)) for j, p in streams))


LoaderPosition = SourcePosition | StreamsPosition


def saved_for_rank(states: list[dict], rank: int) -> dict:
    """``rank``'s state among a checkpoint's saved loader states, every rank's in rank order
    (``states``): rank 0's when the checkpoint had fewer ranks (the loader converts it)."""
    return states[rank] if rank < len(states) else states[0]
