"""What runs in a training loader's DataLoader workers: one epoch of one rank's sample
stream, each worker its own seeded pipeline (shuffle -> fill from the shards -> decode into
its shared-memory slots), and how a worker starts (its signals, its inherited heap frozen).
The main process's side, re-cutting the workers' chunks into equal batches and keeping the
position, is data_pipeline.loader's.
"""

from __future__ import annotations

import functools
import gc
import signal
import time

import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from data_pipeline import epoch_plan, stages
from data_pipeline.epoch_batches import StorageWait
from data_pipeline.parent_death import die_with_parent
from data_pipeline.slots import SlotPool

IMAGE_SIZE = 112


class EpochStream(IterableDataset):
    """One epoch of one rank: each DataLoader worker builds and runs its own pipeline
    (``loader``: the data_pipeline.loader shard loader whose settings it reads)."""

    def __init__(self, loader, epoch: int, skips: list[int]):
        super().__init__()
        self.counts, self.kept = loader.manifest.shard_counts, loader.kept_counts
        self.excluded = loader.excluded
        self.reader = loader.reader
        self.plan = loader.plan_key()
        self.rank, self.epoch, self.skips = loader.rank, epoch, skips
        self.flip, self.decoder = bool(loader.flip), loader.decoder
        self.max_pixels = loader.max_pixels
        self.mirror = loader.flip is True  # in the worker; "deferred": by the consumer
        self.num_classes = loader.manifest.num_classes

    pool: SlotPool | None = None  # set before the DataLoader starts its workers

    def __iter__(self):
        info = get_worker_info()
        assert (info.num_workers if info is not None else 1) == self.plan.num_workers
        return self.chunks(info.id if info is not None else 0, self.pool)

    def chunks(self, worker: int, pool: SlotPool | None = None):
        """The chunk stream of DataLoader worker `worker` (run in that worker, decoding into
        ``pool``'s slots, or in-process)."""
        plan = self.plan
        pieces = epoch_plan.worker_pieces(self.kept, seed=plan.seed, epoch=self.epoch,
                                          rank=self.rank, world_size=plan.world_size,
                                          worker=worker, num_workers=plan.num_workers,
                                          shuffle=plan.shuffle)
        pieces = epoch_plan.with_exclusions(pieces, self.counts, self.excluded)
        skip = self.skips[worker]  # a resumed stream: its reader fetches only what is left
        wanted = stages.wanted(pieces, self._ordered(pieces, worker, skip) if skip else None)
        pipeline = wds.DataPipeline(
            lambda: self._ordered(pieces, worker, skip),
            stages.fill(self.reader.samples(wanted)),
            stages.decode_chunks(IMAGE_SIZE, self.decoder, plan.batch_size, worker,
                                 self.num_classes, pool, self.mirror, self.max_pixels),
        )
        stats = self.reader.stats
        retries, waited, since = stats.retries, stats.wait_s, time.perf_counter()
        for chunk in pipeline:  # each carries what its reads cost since the last one
            now = time.perf_counter()
            cost = StorageWait(stats.retries - retries, stats.wait_s - waited, now - since)
            retries, waited, since = stats.retries, stats.wait_s, now
            yield chunk._replace(storage=cost)

    def _ordered(self, pieces: list[epoch_plan.Piece], worker: int, skip: int):
        """Worker ``worker``'s stream of sample placeholders: shuffled, numbered, flip bits
        drawn, its first ``skip`` passed over (data_pipeline.stages)."""
        plan = self.plan
        tag = f"{plan.seed}-{self.epoch}-{self.rank}-{worker}"
        buffer = plan.shuffle_buffer if plan.shuffle else 0
        return iter(wds.DataPipeline(
            functools.partial(stages.piece_refs, pieces),
            wds.filters.shuffle(buffer, initial=buffer, rng=stages.ShuffleRandom(f"shuffle-{tag}"))
            if buffer > 1 else None,
            stages.annotate(f"flip-{tag}", self.flip, skip),
        ))



def start_worker(worker: int) -> None:
    """DataLoader's ``worker_init_fn``: outlive stop signals, and move the objects the worker
    inherited from its rank into the garbage collector's permanent generation
    (``gc.freeze``), so the worker's collections scan only what it allocates. Otherwise each
    full collection walks, and so copies on write, the rank's whole heap: 183 ms of CPU in a
    worker forked from a process holding torch, deepspeed, wandb and 300k small objects
    (0 ms frozen)."""
    _outlive_stop_signals()
    gc.freeze()


def _outlive_stop_signals() -> None:
    """A worker outlives a SIGTERM, SIGUSR1 or SIGINT sent to every process of the job
    (``scancel``, a batch system's time limit, Ctrl-C): the trainer stops at the next step
    boundary (``trainer.preemption``) and ends its workers itself. SIGUSR1 and SIGINT are
    ignored; the first SIGTERM only re-arms the default, so a second one (DataLoader's
    ``terminate()`` of a stuck worker, multiprocessing's at exit) still ends it. A worker
    whose rank died (SIGKILL, the OOM killer) is killed with it."""
    die_with_parent(signal.SIGKILL)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: signal.signal(signal.SIGTERM, signal.SIG_DFL))


def as_is(chunk: stages.Chunk) -> stages.Chunk:
    """DataLoader collate for ready-made chunks (skips default_convert's recursion)."""
    return chunk
