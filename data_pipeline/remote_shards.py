"""Reading a remote folder's shards in a loader worker: few large requests, fetched ahead.

For each shard of its plan a worker fetches the shard's member index (one request), turns the
positions it wants into byte spans (consecutive samples merged while the gap between them is
under ``gap``: one span per piece in steady state, and after a resume a span that starts at
the byte offset of the first sample still wanted) and cuts the spans into reads of
``block_bytes`` (each in pieces, retried keeping what arrived: data_pipeline.remote). Up to
``prefetch_blocks`` reads (and the next shards' indexes) are in flight on threads while the
worker decodes, so a request's latency is hidden behind the decoding of the blocks before it;
what is held is bounded by those blocks plus the samples the shuffle buffer holds. A shard
without an index is fetched whole and parsed.

With a node-local cache (data_pipeline.shard_cache) each shard is fetched whole into it once,
ahead of its turn, and then read from there like a local shard.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from data_pipeline.errors import ShardError
from data_pipeline.manifest import Manifest, ShardInfo, read_manifest
from data_pipeline.remote import FetchStats, RemoteFolder, Retry, open_folder
from data_pipeline.shard_cache import ShardCache
from data_pipeline.shard_index import (
    INDEX_SUFFIX,
    ShardIndex,
    build_index,
    check_member,
    check_positions,
    index_of,
    indexed_samples,
    parse_index,
    read_index,
)
from data_pipeline.stages import Wanted, tagged
from data_pipeline.tar_reader import BLOCK

MIB = 1 << 20


@dataclass(frozen=True)
class Streaming:
    """How a loader reads a folder at a URL: reads of ``block_mib``, up to
    ``prefetch_blocks`` of them in flight per worker (the bounded buffer), samples more than
    ``gap_mib`` apart read by separate requests, :class:`Retry`'s bounds; with ``cache_dir``,
    whole shards kept there (at most ``cache_gib``, least recently used evicted) and shared
    by the ranks and workers of the node."""

    block_mib: float = 8.0
    prefetch_blocks: int = 4
    gap_mib: float = 1.0
    retry: Retry = field(default_factory=Retry)
    cache_dir: str | None = None
    cache_gib: float = 100.0


@dataclass(frozen=True)
class _ShardPlan:
    """What a worker reads of one shard: its ``positions`` through ``index`` (None: the
    shard is fetched whole, in ``blocks``, and parsed), in ``spans`` (byte ranges and the
    positions in each) fetched as ``blocks``."""

    shard: int
    name: str
    where: str  # the shard's URL, in errors
    positions: list[int]
    index: ShardIndex | None
    spans: list[tuple[int, int, list[int]]]
    blocks: list[tuple[int, int]]


class RemoteShards:
    """The shards of a :class:`RemoteFolder` as a loader reads them (a
    data_pipeline.stages.ShardReader). Built in the rank, before the workers: every shard of
    the manifest must be there with its size (one listing, or a request each where the store
    does not list), so a missing or rewritten shard stops the run before training."""

    def __init__(self, folder: RemoteFolder, shards: tuple[ShardInfo, ...],
                 streaming: Streaming | None = None):
        self.folder, self.infos, self.stats = folder, shards, folder.stats
        self.streaming = streaming = streaming or Streaming()
        names = [s.name for s in shards]
        sizes = folder.sizes(names + [n + INDEX_SUFFIX for n in names])
        for info in shards:
            where = f"{folder.shown}/{info.name}"
            if info.name not in sizes:
                raise ShardError(f"{where}: shard listed in the manifest is missing")
            if sizes[info.name] != info.bytes:
                raise ShardError(f"{where}: {sizes[info.name]} bytes stored, manifest says "
                                 f"{info.bytes} (truncated or rewritten shard)")
        self.indexed = [n + INDEX_SUFFIX in sizes for n in names]
        self.num_unindexed = self.indexed.count(False)
        self.cache = None
        if streaming.cache_dir is not None:
            self.cache = ShardCache(streaming.cache_dir, streaming.cache_gib, folder,
                                    round(streaming.block_mib * MIB))

    def samples(self, wanted: Wanted) -> Iterator[tuple[tuple[int, int], dict]]:
        pool = ThreadPoolExecutor(self.streaming.prefetch_blocks + 2,
                                  thread_name_prefix="shard-fetch")
        try:
            if self.cache is not None:
                yield from self._from_cache(wanted, pool)
            else:
                yield from self._streamed(wanted, pool)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _streamed(self, wanted: Wanted, pool: ThreadPoolExecutor):
        plans = ahead((functools.partial(self._plan, s, p) for s, p in wanted), 2, pool,
                      self.stats)

        def tasks():
            for plan in plans:
                yield functools.partial(_same, plan)
                for lo, hi in plan.blocks:
                    yield functools.partial(self.folder.read, plan.name, lo, hi)

        items = ahead(tasks(), self.streaming.prefetch_blocks, pool, self.stats)
        for plan in items:  # a plan, then its blocks
            blocks = itertools.islice(items, len(plan.blocks))
            yield from tagged(plan.shard, plan.positions, plan.where, _plan_samples(plan, blocks))

    def _from_cache(self, wanted: Wanted, pool: ThreadPoolExecutor):
        cache = self.cache
        fetched = ahead((functools.partial(cache.fetch, self.infos[s], self.indexed[s])
                         for s, _ in wanted), 2, pool, self.stats)
        for (shard, positions), _ in zip(wanted, fetched, strict=True):  # fetched ahead
            # the lock is held while the shard is opened, never across a yield: a worker
            # waiting for its turn to hand out a chunk would hold it while others wait
            with cache.reading(self.infos[shard], self.indexed[shard]) as path:
                samples = indexed_samples(path, read_index(path) or build_index(path),
                                          positions)
            yield from tagged(shard, positions, path, samples)

    def _plan(self, shard: int, positions: list[int]) -> _ShardPlan:
        """Fetch shard ``shard``'s index and plan the requests for ``positions``."""
        info, folder = self.infos[shard], self.folder
        block = round(self.streaming.block_mib * MIB)
        if not self.indexed[shard]:
            return _ShardPlan(shard, info.name, f"{folder.shown}/{info.name}", positions, None,
                              [], _cut([(0, info.bytes)], block))
        where = f"{folder.shown}/{info.name}{INDEX_SUFFIX}"
        raw = folder.read(info.name + INDEX_SUFFIX)
        index = parse_index(io.BytesIO(raw), where, info.bytes)
        check_positions(index, positions, where)
        spans = _spans(index, positions, round(self.streaming.gap_mib * MIB))
        return _ShardPlan(shard, info.name, where.removesuffix(INDEX_SUFFIX), positions, index,
                          spans, _cut([(lo, hi) for lo, hi, _ in spans], block))


def check_remote_folder(url: str) -> Manifest:
    """The manifest at ``url``, its shards checked there with their sizes: what stops a run
    before training (``--check`` included). StorageError or ShardError, one line, if not."""
    folder = open_folder(url)
    manifest = read_manifest(folder)
    if isinstance(folder, RemoteFolder):
        RemoteShards(folder, manifest.shards)
    return manifest


def ahead(tasks: Iterator[Callable], window: int, pool: ThreadPoolExecutor,
          stats: FetchStats) -> Iterator:
    """The results of ``tasks`` in order, each submitted to ``pool`` while up to ``window``
    results before it are not yet taken (so that many run ahead of the consumer). ``tasks``
    itself is drawn in the consumer's thread; the time it waits for a result that is not
    ready goes to ``stats.wait_s``."""
    pending = deque()
    for task in tasks:
        pending.append(pool.submit(task))
        if len(pending) > window:
            yield _result(pending.popleft(), stats)
    while pending:
        yield _result(pending.popleft(), stats)


def _result(future: Future, stats: FetchStats):
    if future.done():
        return future.result()
    start = time.perf_counter()
    try:
        return future.result()
    finally:
        stats.wait_s += time.perf_counter() - start


def _same(value):
    return value


def _spans(index: ShardIndex, positions: list[int], gap: int) -> list[tuple[int, int, list[int]]]:
    """Byte ranges covering the members (their tar headers included) of the samples at
    ``positions``; samples less than ``gap`` bytes apart share a range. A sample with
    neither member is in none (its placeholder gets its key only: corrupt)."""
    spans: list[list] = []
    for position, row in zip(positions, index.members[positions].tolist(), strict=True):
        if row[1] < 0 and row[3] < 0:
            continue
        lo, hi = _extent(*row)
        if spans and lo - spans[-1][1] <= gap:
            spans[-1][1] = max(spans[-1][1], hi)
            spans[-1][2].append(position)
        else:
            spans.append([lo, hi, [position]])
    return [(lo, hi, positions) for lo, hi, positions in spans]


def _cut(ranges: list[tuple[int, int]], block: int) -> list[tuple[int, int]]:
    """``ranges`` as consecutive requests of at most ``block`` bytes."""
    return [(a, min(a + block, hi)) for lo, hi in ranges for a in range(lo, hi, block)]


def _plan_samples(plan: _ShardPlan, blocks: Iterator[bytes]) -> Iterator[dict]:
    """The samples at ``plan.positions``, cut from its ``blocks`` (all of them consumed)."""
    if plan.index is None:  # the whole shard, parsed
        data = b"".join(blocks)
        index = index_of(data, plan.where)
        check_positions(index, plan.positions, plan.where)
        view = memoryview(data)
        for position in plan.positions:
            yield _sample(index, position, lambda a, b, v=view: v[a:b])
        return
    index, ends = plan.index, {plan.positions[0], plan.positions[-1]}
    span_of = {p: i for i, (_, _, positions) in enumerate(plan.spans) for p in positions}
    current, buf, base = -1, b"", 0  # buf holds bytes [base, base + len(buf)) of the shard
    for position in plan.positions:
        span = span_of.get(position)
        if span is None:  # no member: the key alone (the decoder counts it corrupt)
            yield {"__key__": str(index.keys[position])}
            continue
        if span != current:
            current, buf, base = span, b"", plan.spans[span][0]
        jpg, jpg_size, cls, cls_size = index.members[position].tolist()
        first, end = _extent(jpg, jpg_size, cls, cls_size)
        while base + len(buf) < end:
            unused = min(first - base, len(buf))  # bytes before this sample, never needed
            buf, base = buf[unused:] + next(blocks), base + unused
        if position in ends:
            check_member(buf[jpg - BLOCK - base:jpg - base], plan.where,
                         str(index.keys[position]), jpg, jpg_size)
        yield _sample(index, position, lambda a, b, d=buf, o=base: d[a - o:b - o])
    assert next(blocks, None) is None, "blocks planned past the last sample"


def _extent(jpg: int, jpg_size: int, cls: int, cls_size: int) -> tuple[int, int]:
    """The bytes a sample's members take, the tar header of the first one included."""
    members = [(o, n) for o, n in ((jpg, jpg_size), (cls, cls_size)) if n >= 0]
    return min(o for o, _ in members) - BLOCK, max(o + n for o, n in members)


def _sample(index: ShardIndex, position: int, cut: Callable[[int, int], bytes]) -> dict:
    """The sample dict of ``position`` with its members cut from the shard's bytes."""
    jpg, jpg_size, cls, cls_size = index.members[position].tolist()
    sample = {"__key__": str(index.keys[position])}
    if jpg_size >= 0:
        sample["jpg"] = cut(jpg, jpg + jpg_size)
    if cls_size >= 0:
        sample["cls"] = bytes(cut(cls, cls + cls_size))
    return sample


@contextlib.contextmanager
def local_copy(folder: Path | RemoteFolder, name: str, size: int,
               indexed: bool = False) -> Iterator[Path]:
    """Shard ``name`` (``size`` bytes) of ``folder`` as a local file, for the tools that
    read whole shards (verify, the embedding tools, a resumed upload): the shard itself in
    a local folder; else a copy in a temporary folder, with its member index when
    ``indexed``, removed when the block ends (one shard on the disk at a time)."""
    if isinstance(folder, Path):
        yield folder / name
        return
    with tempfile.TemporaryDirectory(prefix="partial-fc-shard-") as staging:
        path = Path(staging) / name
        with open(path, "wb") as f:
            folder.copy_to(name, f, size, round(Streaming.block_mib * MIB))
        if indexed:
            path.with_name(name + INDEX_SUFFIX).write_bytes(folder.read(name + INDEX_SUFFIX))
        yield path
