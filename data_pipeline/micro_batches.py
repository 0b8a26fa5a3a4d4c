"""A rank's share of a ``train.global_batch`` step: one batch source per micro-batch stream,
so that a step's samples are placed by their global position, not by the world size.

A step of ``n`` micro-batches has ``n`` streams. Stream ``j`` is the batch source a run on
``n`` ranks would give rank ``j`` (the shard loader, the mixture or the synthetic stream,
built with ``rank=j, world_size=n``): its batch ``t`` of an epoch is micro-batch ``j`` of
step ``t``. On ``P`` ranks (``P`` divides ``n``, ``k = n / P``), rank ``r`` runs streams
``j = r, r + P, ..., r + (k - 1) P``, one per pass, and hands their batches out in that
order. So micro-batch ``j`` of step ``t`` holds the same images on any world size, every
stream's plan (seed, ``n``, micro-batch, workers) is the same whatever ``P``, and the steps
per epoch are a stream's batches per epoch. The synthetic stream already placed its batches
this way (its batch ``i`` on rank ``r`` is micro-batch ``i P + r``); the shard loader's
contiguous share per rank did not.

A checkpoint records each stream's own position (:class:`~data_pipeline.position.
StreamsPosition`); :meth:`MicroBatchStreams.load_saved` finds stream ``j``'s among all the
saved ranks', so a resume on another world size continues each stream where it stopped:
nothing lost, nothing read twice. Each stream keeps its own ``data.num_workers`` workers: a
rank runs ``k`` times as many as one stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from data_pipeline.epoch_batches import ComposedBatches, EpochBatches
from data_pipeline.position import StreamsPosition


def rank_streams(rank: int, world_size: int, streams: int) -> list[int]:
    """The streams ``rank`` of ``world_size`` runs, in pass order: ``rank + p * world_size``."""
    if streams % world_size:
        raise ValueError(f"{world_size} ranks cannot split {streams} micro-batch streams")
    return list(range(rank, streams, world_size))


class MicroBatchStreams(ComposedBatches):
    """This rank's micro-batch streams as one :class:`EpochBatches` (see the module
    docstring): one batch of each stream in turn, ``k`` per step. ``make(j)`` builds stream
    ``j`` as rank ``j`` of ``streams`` ranks would have its batch source."""

    def __init__(self, make: Callable[[int], EpochBatches], *, rank: int, world_size: int,
                 streams: int):
        self.ids = rank_streams(rank, world_size, streams)
        self.streams = [make(j) for j in self.ids]
        first = self.streams[0]
        self._len = len(first) * len(self.streams)
        self.num_classes, self.num_excluded = first.num_classes, first.num_excluded
        self.num_unindexed, self.reads_url = first.num_unindexed, first.reads_url
        self.dropped_fraction = first.dropped_fraction  # the same drop for every stream

    @property
    def epoch(self) -> int:
        return self.streams[0].epoch

    @property
    def _batches(self) -> int:
        return sum(s.batches_done for s in self.streams)

    @property
    def parts(self) -> list[EpochBatches]:
        return self.streams

    def set_epoch(self, epoch: int) -> None:
        for stream in self.streams:
            stream.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple]:
        with contextlib.ExitStack() as stack:  # each stream's workers end with the epoch
            batches = [stack.enter_context(contextlib.closing(iter(s))) for s in self.streams]
            while True:
                for stream in batches:
                    batch = next(stream, None)
                    if batch is None:
                        return
                    yield batch

    def position(self) -> StreamsPosition:
        return StreamsPosition(tuple((j, s.position())
                                     for j, s in zip(self.ids, self.streams, strict=True)))

    def restore(self, position: StreamsPosition) -> None:
        saved = dict(position.streams)
        for j, stream in zip(self.ids, self.streams, strict=True):
            stream.restore(saved.get(j, position.streams[0][1]))

    def load_state_dict(self, state: dict) -> None:
        self.restore(StreamsPosition.from_dict(state))

    def load_saved(self, states: list[dict], rank: int) -> None:
        """Each stream from its own saved position, whichever rank saved it. A stream no rank
        saved (a checkpoint of a run without ``train.global_batch``, or with another one)
        takes the first saved position, which its source converts (data_pipeline.loader:
        another plan resumes at the same fraction of the epoch)."""
        saved: dict[int, dict] = {}
        for state in states:
            if "streams" in state:
                saved.update((s["stream"], s["position"]) for s in state["streams"])
        fallback = next(iter(saved.values())) if saved else states[0]
        for j, stream in zip(self.ids, self.streams, strict=True):
            stream.load_state_dict(saved.get(j, fallback))
