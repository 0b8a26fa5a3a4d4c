"""Loader throughput per worker vs bare JPEG decoding with the same decoder, interleaved.

    .venv/bin/python bench/loader.py [--images 6000] [--workers 0,1,2] [--repeats 5]

On 112x112 JPEG shards generated in a temp dir. For each worker count N, each repeat times
bare decoding of the shards' own bytes (``decode_image``, the loader's decoder) in N forked
processes at once (in this process for N = 0), then the loader with N workers (images/s from
the first batch to the end of the epoch, so worker start-up is excluded). The ratio per
worker (loader img/s / N / bare img/s per process; the main process counts as the worker at
N = 0) is taken right after its own baseline, so the two sides see the same machine: on a
shared machine (Linux autogroups give a session one share of the CPU however many
processes it runs) N decoders get what N workers get. Prints the median and the range over
the repeats, and the load average. Never run by the tests.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

from data_pipeline import make_loader, read_manifest, write_synthetic_dataset
from data_pipeline.codec import decode_image, resolve_decoder
from data_pipeline.stages import tar_samples


def _decode_all(blobs: list[bytes], decoder: str) -> float:
    start = time.perf_counter()
    for blob in blobs:
        decode_image(blob, 112, decoder)
    return len(blobs) / (time.perf_counter() - start)


def bare_decode_rate(blobs: list[bytes], decoder: str, processes: int) -> float:
    """Images/s per process of ``processes`` processes decoding at once (forked like the
    loader's workers, so they share the CPU as those do; 0: this process)."""
    if processes == 0:
        return _decode_all(blobs, decoder)
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        return statistics.mean(pool.starmap(_decode_all, [(blobs, decoder)] * processes))


def loader_rate(data_dir: Path, workers: int, batch_size: int, decoder: str) -> float:
    loader = make_loader(data_dir, batch_size=batch_size, num_workers=workers, decoder=decoder)
    batches = iter(loader)
    next(batches)
    start = time.perf_counter()
    count = sum(len(labels) for _, labels in batches)
    return count / (time.perf_counter() - start)


def _spread(values: list[float], fmt: str) -> str:
    return (f"{format(statistics.median(values), fmt)} "
            f"[{format(min(values), fmt)}-{format(max(values), fmt)}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=6000)
    parser.add_argument("--workers", default="0,1,2", help="comma-separated worker counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--decoder", default="auto")
    args = parser.parse_args()
    decoder = resolve_decoder(args.decoder)
    counts = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        write_synthetic_dataset(data, num_classes=args.images // 20, images_per_class=20,
                                samples_per_shard=1000)
        manifest = read_manifest(data)
        blobs = [s["jpg"] for shard in manifest.shards for s in tar_samples(data / shard.name)]
        mean_kb = sum(map(len, blobs)) / len(blobs) / 1024
        print(f"{len(blobs)} JPEGs 112x112, mean {mean_kb:.1f} KiB, {os.cpu_count()} CPUs, "
              f"load average before {os.getloadavg()[0]:.2f}; decoder={decoder}, batch "
              f"{args.batch_size}, flip, shuffle buffer 1000")
        bare, rates = {w: [] for w in counts}, {w: [] for w in counts}
        for _ in range(args.repeats):
            for w in counts:
                bare[w].append(bare_decode_rate(blobs, decoder, w))
                rates[w].append(loader_rate(data, w, args.batch_size, decoder))
        print(f"median [range] over {args.repeats} repeats; bare decode per process: that many "
              "processes decoding at once (0: in this one)")
        print(f"{'workers':>8}  {'bare/process':>20}  {'loader img/s':>20}  {'per worker':>20}  "
              f"{'per worker / bare':>18}")
        for w in counts:
            per = [r / max(w, 1) for r in rates[w]]
            ratio = [p / b for p, b in zip(per, bare[w], strict=True)]
            print(f"{w:>8}  {_spread(bare[w], '.0f'):>20}  {_spread(rates[w], '.0f'):>20}  "
                  f"{_spread(per, '.0f'):>20}  {_spread(ratio, '.2f'):>18}")
        print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
