"""Loader throughput vs bare JPEG decoding, on 112x112 JPEG shards generated in a temp dir.

    .venv/bin/python bench/loader.py [--images 6000] [--max-workers N] [--batch-size 128]

Prints single-thread decode rates of PIL and simplejpeg on the shards' own bytes, then for
0 (main process) .. N DataLoader workers the loader's images/s (total and per worker, timed
from the first batch to the end of the epoch, so worker start-up is excluded) and its ratio
to bare decoding with the decoder the loader uses. Never run by the tests.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from data_pipeline import make_loader, read_manifest, write_synthetic_dataset
from data_pipeline.codec import DECODERS, decode_image, resolve_decoder
from data_pipeline.stages import tar_samples


def bare_decode_rate(blobs: list[bytes], decoder: str, repeats: int = 2) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        for blob in blobs:
            decode_image(blob, 112, decoder)
    return repeats * len(blobs) / (time.perf_counter() - start)


def loader_rate(data_dir: Path, workers: int, batch_size: int, decoder: str) -> float:
    loader = make_loader(data_dir, batch_size=batch_size, num_workers=workers, decoder=decoder)
    batches = iter(loader)
    next(batches)
    start = time.perf_counter()
    count = sum(len(labels) for _, labels in batches)
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=6000)
    parser.add_argument("--max-workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--decoder", default="auto")
    args = parser.parse_args()
    decoder = resolve_decoder(args.decoder)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        write_synthetic_dataset(data, num_classes=args.images // 20, images_per_class=20,
                                samples_per_shard=1000)
        manifest = read_manifest(data)
        blobs = [s["jpg"] for shard in manifest.shards for s in tar_samples(data / shard.name)]
        mean_kb = sum(map(len, blobs)) / len(blobs) / 1024
        print(f"{len(blobs)} JPEGs 112x112, mean {mean_kb:.1f} KiB, {os.cpu_count()} CPUs")
        rates = {name: bare_decode_rate(blobs, name) for name in DECODERS
                 if name == "pil" or resolve_decoder("auto") == "simplejpeg"}
        for name, rate in rates.items():
            print(f"bare decode {name:>10}: {rate:8.0f} img/s (1 thread)")
        if len(rates) == 2:
            print(f"simplejpeg / PIL: {rates['simplejpeg'] / rates['pil']:.2f}x")
        print(f"\nloader (decoder={decoder}, batch {args.batch_size}, flip, shuffle buffer 1000)")
        print(f"{'workers':>8} {'img/s':>9} {'per worker':>11} {'vs bare decode':>15}")
        for workers in range(0, args.max_workers + 1):
            rate = loader_rate(data, workers, args.batch_size, decoder)
            per = rate / max(workers, 1)
            print(f"{workers:>8} {rate:9.0f} {per:11.0f} {rate / rates[decoder]:14.2f}x")


if __name__ == "__main__":
    main()
