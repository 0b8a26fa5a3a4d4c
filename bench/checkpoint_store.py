"""A checkpoint into an object store two ways, timed on moto's S3 server on loopback: what
``trainer.checkpoint`` does (DCP into a local folder, each file hashed there and uploaded)
against DCP writing through fsspec straight to the URL (``FsspecWriter``), whose files must
then be read back from the store to be hashed for meta.json.

Why: a checkpoint in a store is complete only with the SHA-256 of every file in its
manifest. Staging pays one local write and read; writing through fsspec pays one download of
every byte instead. Loopback moto is the cheap end of both (no network, no per-request
latency); the figure to read is the ratio.

    .venv/bin/python bench/checkpoint_store.py --mib 64 --repeats 5
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from data_pipeline.store import StoreFolder, open_store  # noqa: E402
from tools.remote_servers import S3Server  # noqa: E402


def staged(state: dict, store: StoreFolder, tag: str) -> None:
    """trainer.checkpoint's way: DCP locally, hash, upload, meta last."""
    with tempfile.TemporaryDirectory() as tmp:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
        hashes = {}
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file():
                name = path.relative_to(tmp).as_posix()
                hashes[name] = hashlib.sha256(path.read_bytes()).hexdigest()
                store.put(f"{tag}/{name}", path)
        store.put(f"{tag}/meta.json", repr(hashes).encode())


def through_fsspec(state: dict, store: StoreFolder, tag: str) -> None:
    """DCP straight to the URL, then every file read back to be hashed, meta last (torch
    keeps its fsspec writer in a private module)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    dcp.save(state, storage_writer=FsspecWriter(store.url_of(tag)))
    hashes = {name: hashlib.sha256(store.get(name) or b"").hexdigest()
              for name in store.tree(tag)}
    store.put(f"{tag}/meta.json", repr(hashes).encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="checkpoint size in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = args.mib * (1 << 20) // (4 * 512)
    state = {"head.weight": torch.randn(rows, 512), "backbone.w": torch.randn(1000, 1000)}
    server = S3Server()
    server.make_bucket("bench")
    os.environ.update(server.environment())
    try:
        store = open_store("s3://bench/run")
        assert isinstance(store, StoreFolder)
        times: dict[str, list[float]] = {"staged": [], "through fsspec": []}
        for i in range(args.repeats):
            for name, way in (("staged", staged), ("through fsspec", through_fsspec)):
                start = time.perf_counter()
                way(state, store, f"{name.replace(' ', '-')}-{i}")
                times[name].append(time.perf_counter() - start)
        size = sum(t.numel() * 4 for t in state.values()) / (1 << 20)
        print(f"checkpoint of {size:.0f} MiB into moto S3 on loopback, {args.repeats} repeats "
              f"(median, min-max):")
        for name, got in times.items():
            print(f"  {name:15s} {statistics.median(got):6.2f} s  ({min(got):.2f}-{max(got):.2f})")
    finally:
        server.close()


if __name__ == "__main__":
    main()
