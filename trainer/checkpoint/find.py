"""Finding the checkpoint to read: ``checkpoint.resume`` for training (:func:`find_resume`,
rank 0 reads and hashes, every rank gets the answer), a run or checkpoint folder for the
tools (:func:`find_verified`), ``latest``'s target or else the newest ``step-*`` that
verifies (``trainer.checkpoint.layout`` says the layout; ``trainer.checkpoint.in_store`` the
same for a run folder at a URL)."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Collection
from pathlib import Path

import torch.distributed as dist

from data_pipeline.door import read_text
from data_pipeline.errors import DataError
from data_pipeline.store import StorageError, StoreFolder, open_store, staging_dir
from data_pipeline.store import in_store as is_store_url
from trainer.checkpoint import in_store
from trainer.checkpoint.integrity import META, CheckpointError, CheckpointNotFound, verify
from trainer.dist import DistEnv

LATEST = "latest"


def find_resume(run_dir: Path, resume: str, env: DistEnv | None = None,
                store: StoreFolder | None = None) -> Path | None:
    """``checkpoint.resume`` -> the verified folder to resume from; collective over
    ``env``'s ranks (rank 0 reads and hashes, every rank gets its answer), or this process
    alone with ``env=None``.

    ``none``: start fresh; ``auto``: ``run_dir``'s newest checkpoint that verifies, if any
    (``store``: the run folder is there, ``run_dir`` this node's copy); otherwise a
    checkpoint folder (must verify) or another run's folder (as ``auto``), either may be a
    URL. A checkpoint in a store is copied into this node's copy of its folder and verified
    there; the first rank of every other node copies it too.
    Raises :class:`CheckpointError` when checkpoints exist but none verifies.
    """
    if resume == "none":
        return None
    if resume != "auto" and is_store_url(resume):
        store, run_dir = open_store(resume), staging_dir(resume, "resume")
    elif resume != "auto":
        store = None
    if env is None or env.world_size == 1:
        return _choose(run_dir, resume, store)
    answer: list = [None, None, None]  # [folder, error, the copy's mark]
    if env.is_main:
        try:
            answer[0] = _choose(run_dir, resume, store)
        except (CheckpointError, CheckpointNotFound) as err:
            answer[1] = err  # its kind decides the exit code on every rank
        if answer[0] is not None and store is not None:
            answer[2] = Path(run_dir) / f".fetched-{uuid.uuid4().hex}"
            answer[2].touch()
    dist.broadcast_object_list(answer, src=0, group=env.group)
    if answer[1] is not None:
        raise answer[1]
    if answer[2] is not None:  # no shared disk: the first rank of another node copies it too
        if env.local_rank == 0 and not answer[2].exists():
            _choose(run_dir, resume, store)
        dist.barrier(group=env.group)
        if env.is_main:
            answer[2].unlink()
    return answer[0]


def _choose(run_dir: Path, resume: str, store: StoreFolder | None) -> Path | None:
    remedy = "; start over with checkpoint.resume=none or another name"
    if store is not None:
        try:
            found = in_store.fetch_verified(store, Path(run_dir), remedy)
        except StorageError as err:  # the store out of reach: every rank learns it
            raise CheckpointError(f"{err}; resume once it answers again") from None
    else:
        found = find_verified(Path(run_dir) if resume == "auto" else Path(resume), remedy)
    if found is None and resume != "auto":
        raise CheckpointNotFound(f"checkpoint.resume={resume!r}: no checkpoint there")
    return found


def find_verified(folder: Path, remedy: str = "", only: Collection[str] | None = None
                  ) -> Path | None:
    """The checkpoint ``folder`` names, verified (this process alone; not collective: its
    warnings go to stderr from here, rank 0 in training); ``only``: hash just these files
    (``trainer.checkpoint.integrity.verify``), for a reader of a part.

    A checkpoint folder (it holds meta.json) must verify itself: no fallback. A run folder
    gives ``latest``'s target or, when that one is missing or fails verification, the
    newest ``step-*`` that verifies, with a warning line for each refused one; None when it
    holds no checkpoint. Used by training's resume and by ``trainer.checkpoint.backbone``. Raises
    :class:`CheckpointError` (its message ends with ``remedy``) when checkpoints exist but
    none verifies.
    """
    folder = Path(folder)
    if (folder / META).is_file():
        verify(folder, only)
        return folder
    root = folder / "checkpoints"
    candidates = _candidates(root)
    for i, path in enumerate(candidates):
        try:
            verify(path, only)
        except CheckpointError as err:
            warn(f"warning: {err}; trying an older checkpoint")
            continue
        if i > 0 or path.name != latest_name(root):
            warn(f"warning: {root / LATEST} does not name a usable checkpoint; "
                       f"using {path.name}, the newest complete one")
        return path
    if candidates:
        raise CheckpointError(f"{root}: no checkpoint verifies (see the warnings above){remedy}")
    return None


def warn(message: str) -> None:
    """A warning line on stderr (this process's: rank 0 in training)."""
    print(message, file=sys.stderr)


def latest_name(root: Path) -> str | None:
    try:  # a few bytes: a checkpoint's name
        name = read_text(root / LATEST, LATEST, limit=4096).strip()
    except DataError:  # missing, unreadable, too long, not UTF-8: no latest
        return None
    return name if name and "/" not in name and name not in (".", "..") else None


def _candidates(root: Path) -> list[Path]:
    """``latest``'s target, then every ``step-*`` newest first, each holding a meta.json."""
    named = latest_name(root)
    ordered = [root / named] if named else []
    ordered += sorted((p for p in root.glob("step-*") if p.name != named), reverse=True)
    return [p for p in ordered if (p / META).is_file()]
