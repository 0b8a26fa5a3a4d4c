"""Checkpoint storage: torch.distributed.checkpoint (DCP) folders, verified, replaced safely.

Layout (the contract others read)::

    RUN/checkpoints/<tag>/state/          DCP: each rank's block of head rows, rank-deduped
                                          replicated tensors (the plan: trainer.checkpoint.state)
    RUN/checkpoints/<tag>/backbone.pt     plain full fp32 backbone state_dict (rank 0)
    RUN/checkpoints/<tag>/rng-<rank>.pt   that rank's torch RNG state (CPU, and CUDA on GPU)
    RUN/checkpoints/<tag>/meta.json       step, world size, loader positions, row keys, and
                                          ``files``: the SHA-256 of every other file; written
                                          last, so its presence marks a complete checkpoint
    RUN/checkpoints/latest                the name of the newest complete folder

Writing: everything goes into ``checkpoints/.tmp-<tag>``, then rank 0 renames it to ``<tag>``
and rewrites ``latest`` (temp file + fsync + ``os.replace``). When ``<tag>`` already exists
(the same step saved again after a resume), ``latest`` first names the complete
``.tmp-<tag>``, so at every instant ``latest`` or the fallback below finds a complete
checkpoint. A failed save (disk full: reported as ENOSPC) removes its ``.tmp-*`` on every
rank's word; the newest ``checkpoint.keep`` folders and ``latest``'s target are kept.

Reading (``trainer.checkpoint.find``: ``find_verified``; in training ``find_resume``, rank 0,
then broadcast; ``launch.evaluate`` and ``launch.export`` through
``trainer.checkpoint.backbone``): ``latest``'s target, or when it is missing, empty, dangling
or fails verification, the newest ``step-*`` that verifies, with a warning. Verification
(``trainer.checkpoint.integrity``) hashes every file against ``meta.json`` *before* anything is
unpickled (``trainer.checkpoint.backbone`` hashes only the ``backbone.pt`` it reads); DCP's
``.metadata`` (a pickle) is then read with an allow-list unpickler and the tensors with
``weights_only=True``, so a planted file can neither run code nor load silently.

Head rows: each rank saves its block ``[start, stop)`` as a plain tensor named
``<key>/rows.<start>.<stop>``; a run on any number of ranks loads the blocks that overlap
its own rows and slices them (the head's remainder-balanced partition is not DTensor's
``torch.chunk`` split, and no private ShardedTensor API is needed). Multi-node runs need RUN
on a file system every node sees, or at an object store's URL: then each rank stages its part
on its own node and uploads it, and a resume copies the checkpoint to each node
(``trainer.checkpoint.in_store``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from data_pipeline.manifest import atomic_write_bytes, fsync_dir
from data_pipeline.store import StorageError, StoreFolder
from trainer import seams
from trainer.checkpoint import in_store, state
from trainer.checkpoint.find import LATEST, latest_name
from trainer.checkpoint.integrity import (
    META,
    CheckpointError,
    SafeReader,
    read_meta,
    sha256,
)
from trainer.checkpoint.meta import CheckpointMeta, RunRecord
from trainer.dist import DistEnv
from trainer.engine.state import EngineState

_BLOCK = re.compile(r"^(?P<key>.+)/rows\.(?P<start>\d+)\.(?P<stop>\d+)$")


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


# ----------------------------------------------------------------------------- save


def save(run_dir: Path, step: int, engine, record: RunRecord, keep: int,
         store: StoreFolder | None = None) -> Path:
    """Write checkpoint ``step`` of ``engine`` (collective); returns its folder.

    ``record`` must be JSON-able; its ``loader`` (this rank's loader position) is gathered
    into a per-rank list (:class:`~trainer.checkpoint.meta.CheckpointMeta`). Raises
    :class:`CheckpointError` on every rank when the state is not finite (nothing is written
    or pruned) or when any rank fails to write. The ranks are ``engine.env``'s. ``store``:
    the run folder is in that object store and ``run_dir`` is this node's copy; each rank
    stages its part there and uploads it (``trainer.checkpoint.in_store``), and the folder
    returned is the store's (as this node's copy would name it).
    """
    env = engine.env
    rank, world = env.rank, env.world_size
    root = Path(run_dir) / "checkpoints"
    tag = tag_for(step)
    tmp, final = root / f".tmp-{tag}", root / tag
    where = str(root) if store is None else store.url_of(in_store.ROOT)
    if store is not None:  # each rank's own folder: the nodes share no disk
        tmp = root / f".upload-{tag}-rank{rank}"
    full = state.collect(engine)
    _refuse_non_finite(full, step, env)
    rows = sorted(k for k, v in full.items() if isinstance(v, state.Rows))
    loaders: list = [None] * world
    dist.all_gather_object(loaders, record.loader, group=env.group)

    def prepare() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if store is not None and rank == 0:
            in_store.remove_incomplete(store, tag)

    def forget() -> None:  # a failed save: this rank's staged part (and what it uploaded)
        shutil.rmtree(tmp, ignore_errors=True)
        if store is not None and rank == 0:
            with contextlib.suppress(StorageError):
                in_store.remove_incomplete(store, tag)

    on_every_rank = functools.partial(_on_every_rank, what=f"saving step {step} into {where}",
                                      forget=forget if store is not None or rank == 0 else None,
                                      env=env)
    on_every_rank(prepare if store is not None or rank == 0 else None)
    flat = {}
    for key, value in full.items():
        if isinstance(value, state.Rows):
            stop = value.offset + value.local.shape[0]
            flat[f"{key}/rows.{value.offset}.{stop}"] = value.local.detach().cpu()
        else:
            flat[key] = value.detach().cpu()
    hashes: dict[str, str] = {}

    def to_write(name: str) -> Path:  # what this rank writes next (seams.CHECKPOINT_WRITE)
        seams.CHECKPOINT_WRITE(tmp / name, step=step, rank=rank)
        return tmp / name

    def write() -> None:
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(to_write("state")))
        torch.save(_rng_state(engine.device), to_write(f"rng-{rank}.pt"))
        mine = [f"rng-{rank}.pt", *(f"state/{p.name}" for p in (tmp / "state").glob(f"__{rank}_*"))]
        if rank == 0:
            torch.save(_plain_backbone(full, engine), to_write("backbone.pt"))
            mine += ["backbone.pt", "state/.metadata"]
        hashes.update({name: sha256(tmp / name) for name in mine})

    on_every_rank(write)
    if store is not None:
        on_every_rank(lambda: in_store.upload(store, tmp, tag, hashes))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, hashes, group=env.group)
    info = CheckpointMeta.of(record, step=step, world_size=world, loaders=loaders, rows=rows,
                             files=dict(sorted(kv for part in gathered for kv in part.items())))

    def publish() -> None:
        if store is not None:
            in_store.publish(store, tag, info.to_json().encode(), keep)
            return
        atomic_write_bytes(to_write(META), info.to_json().encode())
        _replace(root, tmp, final)
        _prune(root, keep)

    on_every_rank(publish if rank == 0 else None)
    if store is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _on_every_rank(action: Callable[[], None] | None, what: str,
                   forget: Callable[[], None] | None, env: DistEnv) -> None:
    """Run ``action`` here (None: nothing), then agree: if it failed on any rank, every
    rank calls ``forget`` (the partial save's cleanup, None: nothing) and raises the same
    :class:`CheckpointError`, which says that the last complete checkpoint stays
    (collective)."""
    error = None
    if action is not None:
        try:
            action()
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            error = _describe(exc)  # reported by every rank: none is left waiting
    errors: list = [None] * env.world_size
    dist.all_gather_object(errors, error, group=env.group)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        if forget is not None:
            forget()
        rank, message = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {message}; the last complete "
                              "checkpoint stays")


def _describe(exc: BaseException) -> str:
    """One line for a failed write; disk full is named as such, also inside DCP's wrapper."""
    causes = [exc]
    if isinstance(exc, CheckpointException):
        causes += [failure for failure, _ in exc.failures.values()]
    for cause in causes:
        while cause is not None:
            if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
                return f"no space left on the device (ENOSPC): {cause.filename or cause}"
            cause = cause.__cause__ or cause.__context__
    if isinstance(exc, CheckpointException):
        first = next(iter(exc.failures.values()))[0]
        return f"{type(first).__name__}: {first}"
    return f"{type(exc).__name__}: {exc}"


def _refuse_non_finite(full: dict, step: int, env: DistEnv) -> None:
    """Raise on every rank, before anything is written or pruned, if any rank's state holds
    inf/NaN: a checkpoint must never replace good ones with a diverged model (collective)."""
    bad = [
        key
        for key, value in full.items()
        if (t := value.local if isinstance(value, state.Rows) else value).is_floating_point()
        and not bool(torch.isfinite(t).all())
    ]
    flag = torch.tensor([len(bad)], device=env.device)  # NCCL reduces device tensors only
    dist.all_reduce(flag, group=env.group)
    if int(flag):
        where = f"{bad[0]} and {len(bad) - 1} more" if bad else "another rank's state"
        raise CheckpointError(f"not saving step {step}: non-finite values in {where}")


def _replace(root: Path, tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final`` and point ``latest`` at it (rank 0).

    An existing ``final`` (the same step saved again) is removed only after ``latest``
    names ``tmp``; between the rename and the last write ``latest`` dangles for an instant,
    which :func:`find_resume` answers with the newest complete ``step-*``: ``final``.
    """
    if final.exists():
        _point_latest(root, tmp.name)
        shutil.rmtree(final)
        seams.CHECKPOINT_REPLACED(final)
    tmp.rename(final)
    fsync_dir(root)
    _point_latest(root, final.name)


def _point_latest(root: Path, name: str) -> None:
    atomic_write_bytes(root / LATEST, (name + "\n").encode())


def _prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints and ``latest``'s target; drop the rest
    and every ``.tmp-*`` (rank 0, after a save completed: no other save is writing)."""
    current = latest_name(root)
    tags = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in [*tags[:-keep], *root.glob(".tmp-*")]:
        if old.name != current:
            shutil.rmtree(old, ignore_errors=True)


def remove_stale(run_dir: Path) -> None:
    """Remove ``.tmp-*`` folders that interrupted saves left (rank 0, before training);
    ``latest``'s target is kept even when it is one (a kill inside :func:`_replace`)."""
    root = Path(run_dir) / "checkpoints"
    current = latest_name(root)
    for tmp in root.glob(".tmp-*"):
        if tmp.name != current:
            shutil.rmtree(tmp, ignore_errors=True)


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The generators a step draws from: torch's CPU one, and the device's on CUDA (dropout)."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def _plain_backbone(full: dict, engine) -> dict[str, torch.Tensor]:
    """The backbone state_dict, with the fp32 master weights where its engine keeps them."""
    sections = EngineState.from_flat({k: v for k, v in full.items()
                                      if not isinstance(v, state.Rows)})
    master = engine.backend.master_weights(sections.backbone_optimizer)
    return {name: master.get(name, value).detach().cpu().clone()
            for name, value in sections.backbone.items()}


# ----------------------------------------------------------------------------- load


def load(path: Path, engine) -> CheckpointMeta:
    """Restore ``engine`` from checkpoint folder ``path`` on any world size (collective over
    ``engine.env``'s ranks); returns its meta (``loaders``: every rank's loader position, of
    which the batch source's ``load_saved`` takes this rank's).

    ``path`` should come from :func:`find_resume` (verified).
    """
    path = Path(path)
    meta = read_meta(path)
    reader = SafeReader(path / "state")
    head = engine.head
    lo, hi = head.row_start, head.row_start + head.weight.shape[0]
    template: dict[str, torch.Tensor] = {}
    for key, md in reader.read_metadata().state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{path}: entry {key!r} is not a tensor; not a partial-fc "
                                  "checkpoint")
        block = _BLOCK.match(key)
        if block is None or (int(block["start"]) < hi and int(block["stop"]) > lo):
            template[key] = torch.zeros(md.size, dtype=md.properties.dtype)
    dcp.load(template, storage_reader=reader)
    flat = {k: v for k, v in template.items() if _BLOCK.match(k) is None}
    for key in meta.rows:
        flat[key] = _my_rows(template, key, lo, hi)
    state.restore(engine, flat)
    rank = engine.env.rank
    rng = path / f"rng-{rank}.pt"
    if rng.is_file():
        saved = torch.load(rng, weights_only=True)
        torch.set_rng_state(saved["cpu"])
        if "cuda" in saved and engine.device.type == "cuda":
            torch.cuda.set_rng_state(saved["cuda"], engine.device)
    return meta


def read_rows(path: Path, key: str) -> torch.Tensor:
    """Every row of the row-sharded entry ``key`` (``head.weight``: ``[K * C, D]``) of the
    verified checkpoint folder ``path``, joined from the blocks of all ranks that saved it, on
    the CPU: for a tool that needs the whole matrix (``launch.clean``). Collective when a
    process group is up (DCP's load): every rank calls it."""
    reader = SafeReader(Path(path) / "state")
    template = {}
    for name, md in reader.read_metadata().state_dict_metadata.items():
        block = _BLOCK.match(name)
        if block is not None and block["key"] == key and isinstance(md, TensorStorageMetadata):
            template[name] = torch.zeros(md.size, dtype=md.properties.dtype)
    if not template:
        raise CheckpointError(f"{path}: holds no rows of {key!r}; not a partial-fc checkpoint")
    dcp.load(template, storage_reader=reader)
    return _my_rows(template, key, 0, max(int(_BLOCK.match(n)["stop"]) for n in template))


def _my_rows(blocks: dict[str, torch.Tensor], key: str, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``key`` cut from the saved blocks that overlap them."""
    parts = []
    for name, tensor in blocks.items():
        match = _BLOCK.match(name)
        if match is not None and match["key"] == key:
            start = int(match["start"])
            parts.append((start, tensor[max(lo - start, 0) : max(hi - start, 0)]))
    rows = torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])])
    if rows.shape[0] != hi - lo:
        raise CheckpointError(f"{key}: the checkpoint holds {rows.shape[0]} of rows [{lo}, {hi})")
    return rows
