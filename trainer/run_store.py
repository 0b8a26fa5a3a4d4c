"""A run folder in an object store (``output=s3://bucket/runs/a``, any fsspec URL that
writes): the node-local copy the run writes, and rank 0's mirror of it to the store.

The trainer writes its run files as it does into a local folder, into ``cfg.run_dir``, which
for a store URL is a folder on this node (``data_pipeline.store.staging_dir``, under
``TMPDIR``); nothing needs a file system shared between nodes. :class:`RunMirror` (rank 0)
first copies back what a resumed run appends to (metrics, histograms, train.log, the W&B run
id), then uploads the run files that changed every :data:`SYNC_S` seconds and once more at
the end, with the W&B offline folder and the TensorBoard events. Checkpoints go to the store
by themselves (``trainer.checkpoint.layout``), the lock is a lease in it
(``trainer.store_lock``).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from data_pipeline.store import StorageError, StoreFolder, in_store, open_store, staging_dir
from trainer.config.schema import Config
from trainer.dist import DistEnv
from trainer.telemetry import run_files
from trainer.telemetry.console import LOG_FILE
from trainer.telemetry.sinks import TENSORBOARD_DIR, WANDB_ID_FILE

SYNC_S = 30.0  # seconds between two uploads of the run files: a bounded request rate
CONFIG_FILE = "config.yaml"
RUN_FILES = (CONFIG_FILE, run_files.METRICS, run_files.HISTOGRAMS, LOG_FILE, run_files.SUMMARY,
             WANDB_ID_FILE)
APPENDED = (run_files.METRICS, run_files.HISTOGRAMS, LOG_FILE, WANDB_ID_FILE)
TREES = ("wandb", TENSORBOARD_DIR)  # uploaded at the end


class RunMirror:
    """Rank 0's uploads of the run folder ``local`` to ``store``; :meth:`start` after the
    lock is held, :meth:`close` at the end (the last upload, with the trees)."""

    def __init__(self, store: StoreFolder, local: Path, every_s: float = SYNC_S):
        self.store, self.local, self.every_s = store, local, every_s
        self._sent: dict[str, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: str | None = None  # the last upload's error, said once at the end

    def start(self) -> None:
        """Empty the local copy (another run's files), fetch what a resumed run appends to,
        and start the periodic uploads."""
        shutil.rmtree(self.local, ignore_errors=True)
        self.local.mkdir(parents=True)
        present = self.store.tree()
        for name in APPENDED:
            if name in present:
                self.store.download(name, self.local / name)
                self._sent[name] = self._stamp(self.local / name)
        self._thread = threading.Thread(target=self._loop, name="run-mirror", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.push()

    @staticmethod
    def _stamp(path: Path) -> tuple[int, int]:
        stat = path.stat()
        return stat.st_size, stat.st_mtime_ns

    def push(self, names: tuple[str, ...] = RUN_FILES) -> None:
        """Upload those of ``names`` that changed since their last upload; a store out of
        reach is remembered (:attr:`failure`) and tried again at the next push."""
        for name in names:
            path = self.local / name
            try:
                stamp = self._stamp(path)
                if self._sent.get(name) != stamp:
                    self.store.put(name, path)
                    self._sent[name] = stamp
            except FileNotFoundError:
                continue
            except StorageError as err:
                self.failure = str(err)

    def close(self) -> str | None:
        """Stop the periodic uploads, upload the run files and the trees; returns one line
        when an upload failed (the local copy keeps everything), else None."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.failure = None
        trees = tuple(p.relative_to(self.local).as_posix() for tree in TREES
                      if (self.local / tree).is_dir()
                      for p in sorted((self.local / tree).rglob("*")) if p.is_file())
        self.push(RUN_FILES + trees)
        if self.failure is None:
            return None
        return (f"warning: the run files did not all reach {self.store.shown} ({self.failure}); "
                f"they are in {self.local}")


def fetch_run_files(url: str, names: tuple[str, ...] = RUN_FILES) -> Path:
    """A local copy of the run files ``names`` of the run folder at ``url`` (those it holds),
    for a reader such as ``launch.report``; its folder (``staging_dir(url, "read")``)."""
    store = open_store(url)
    assert isinstance(store, StoreFolder), url
    local = staging_dir(url, "read")
    present = store.tree()
    for name in names:
        if name in present:
            store.download(name, local / name)
        else:
            (local / name).unlink(missing_ok=True)
    return local


def store_of(cfg: Config) -> StoreFolder | None:
    """The store that holds ``cfg``'s run folder, None for a local (or shared) folder."""
    store = open_store(cfg.run_location) if in_store(cfg.run_location) else None
    assert store is None or isinstance(store, StoreFolder), cfg.run_location
    return store


@contextlib.contextmanager
def mirrored(location: str, run_dir: Path, env: DistEnv) -> Iterator[None]:
    """Rank 0 mirrors ``run_dir`` to the store ``location`` for the block (nothing for a local
    folder); collective: a store rank 0 cannot read at the start ends every rank with the
    same :class:`StorageError`, and no rank meets a copy being emptied."""
    if not in_store(location):
        yield
        return
    mirror, failed = None, [None]
    if env.is_main:
        try:
            store = open_store(location)
            assert isinstance(store, StoreFolder), location
            mirror = RunMirror(store, run_dir)
            mirror.start()
        except StorageError as err:
            failed[0] = str(err)
    if env.world_size > 1:
        dist.broadcast_object_list(failed, src=0, group=env.group)
    if failed[0] is not None:
        raise StorageError(failed[0])
    try:
        yield
    finally:
        if mirror is not None and (line := mirror.close()) is not None:
            print(line, file=sys.stderr, flush=True)
