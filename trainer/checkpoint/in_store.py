"""Checkpoints of a run folder in an object store (``output=s3://...``): the same layout as
``trainer.checkpoint.layout``'s, written without a rename and read back through a local copy.

A store has no rename, so a save writes straight into ``checkpoints/<tag>/``: each rank writes
its part (DCP's file of its rows, its RNG state; rank 0 also ``backbone.pt`` and DCP's
``.metadata``) into a folder of its own on its node's disk, hashes it there and uploads it;
once every rank's upload is done, rank 0 uploads ``meta.json`` (the SHA-256 of every file),
then ``latest``. A save cut off before ``meta.json`` leaves a folder with no manifest, which
no reader takes (:func:`fetch_verified` lists only folders that hold one) and the next save
removes. Staging on local disk and uploading costs one local write more than DCP writing
through fsspec, and hashes the bytes written instead of reading them back from the store.

Reading: the candidates are ``latest``'s target, then every ``step-*`` newest first, each
holding a ``meta.json``; the first whose files are all there (from the store's listing) and
whose downloaded files match their SHA-256 is used, with the warnings of a local folder's.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Collection
from pathlib import Path

from data_pipeline.store import StorageError, StoreFolder, open_store, staging_dir
from trainer.checkpoint.integrity import META, CheckpointError, verify

LATEST = "latest"
ROOT = "checkpoints"
BACKBONE = "backbone.pt"
CONFIG = "config.yaml"


def upload(store: StoreFolder, staged: Path, tag: str, names: Collection[str]) -> None:
    """This rank's files ``names`` of its staged folder to ``checkpoints/<tag>/``."""
    for name in names:
        store.put(f"{ROOT}/{tag}/{name}", staged / name)


def publish(store: StoreFolder, tag: str, meta_json: bytes, keep: int) -> None:
    """Rank 0, once every rank's part is in the store: ``meta.json`` (the checkpoint is
    complete from here), ``latest``, then the older folders beyond ``keep`` removed."""
    store.put(f"{ROOT}/{tag}/{META}", meta_json)
    store.put(f"{ROOT}/{LATEST}", (tag + "\n").encode())
    for old in sorted(_complete(store.tree(ROOT)))[:-keep]:
        store.remove_tree(f"{ROOT}/{old}")


def remove_incomplete(store: StoreFolder, tag: str) -> None:
    """Rank 0 before a save of ``tag``: what an earlier save of ``tag`` left there, manifest
    first (from then on no reader takes the folder), then every other folder without one
    (saves that were cut off)."""
    store.remove(f"{ROOT}/{tag}/{META}")
    listing = store.tree(ROOT)
    complete = _complete(listing)
    for name in listing:
        parts = name.split("/")
        if len(parts) > 2 and parts[1] not in complete:
            store.remove(name)


def _complete(listing: Collection[str]) -> set[str]:
    """The ``step-*`` folders of a listing of ``checkpoints/`` that hold a ``meta.json``."""
    return {n.split("/")[1] for n in listing if n.startswith(f"{ROOT}/step-")
            and n.endswith(f"/{META}") and n.count("/") == 2}


def fetch_verified(store: StoreFolder, local: Path, remedy: str = "",
                   only: Collection[str] | None = None) -> Path | None:
    """The checkpoint the store folder names (a checkpoint folder: it, or nothing; a run
    folder: ``latest``'s target, else the newest complete one), verified, as a local copy
    under ``local`` (its ``only`` files, every file when None); None when the folder holds
    no checkpoint. Raises :class:`CheckpointError` (ending with ``remedy``) when checkpoints
    exist but none verifies."""
    listing = store.tree()
    if META in listing:
        return _fetch(store, "", listing, local, only)
    named = (store.get(f"{ROOT}/{LATEST}") or b"").decode(errors="replace").strip()
    tags = sorted(_complete(listing), reverse=True)
    candidates = ([named] if named in tags else []) + [t for t in tags if t != named]
    for i, tag in enumerate(candidates):
        prefix = f"{ROOT}/{tag}/"
        files = {n[len(prefix):]: size for n, size in listing.items() if n.startswith(prefix)}
        try:
            path = _fetch(store, prefix, files, local / ROOT / tag, only)
        except CheckpointError as err:
            _warn(f"warning: {err}; trying an older checkpoint")
            continue
        if i > 0 or tag != named:
            _warn(f"warning: {store.url_of(ROOT)}/{LATEST} does not name a usable checkpoint; "
                  f"using {tag}, the newest complete one")
        return path
    if candidates:
        raise CheckpointError(f"{store.url_of(ROOT)}: no checkpoint verifies (see the warnings "
                              f"above){remedy}")
    return None


def _fetch(store: StoreFolder, prefix: str, files: dict[str, int], local: Path,
           only: Collection[str] | None) -> Path:
    """Download ``prefix``'s ``meta.json`` and its ``only`` files into ``local`` (emptied
    first) and verify them against the store's listing ``files``."""
    shutil.rmtree(local, ignore_errors=True)
    wanted = [META, *(n for n in files if n != META and (only is None or n in only))]
    try:
        for name in wanted:
            store.download(prefix + name, local / name)
    except StorageError as err:
        raise CheckpointError(str(err)) from None
    shown = store.url_of(prefix.rstrip("/")) if prefix else store.url
    verify(local, only, present=files, shown=shown)
    return local


def fetch_checkpoint(url: str) -> tuple[Path, Path]:
    """``(RUN/config.yaml, .../backbone.pt)`` of a local copy of the run or checkpoint at
    ``url`` (``RUN``, ``RUN/checkpoints/<tag>`` or its ``backbone.pt``), ``backbone.pt``
    verified as a local folder's (the rest of the checkpoint listed, not downloaded)."""
    run, _, tag = url.rstrip("/").removesuffix("/backbone.pt").partition(f"/{ROOT}/")
    local = staging_dir(run, "read")
    where = local / ROOT / tag if tag else local
    try:
        store = open_store(run)
        target = open_store(f"{run}/{ROOT}/{tag}") if tag else store
        found = fetch_verified(target, where, only=(BACKBONE,))
        if found is None:
            raise CheckpointError(f"{url}: no checkpoint there (give the `output` URL of "
                                  "launch.train, or RUN/checkpoints/<tag>)")
        store.download(CONFIG, local / CONFIG)
    except StorageError as err:
        raise CheckpointError(str(err)) from None
    return local / CONFIG, found / BACKBONE


def _warn(message: str) -> None:
    print(message, file=sys.stderr)
