"""Loader throughput per worker vs bare JPEG decoding with the same decoder, interleaved.

    .venv/bin/python bench/loader.py [--images 6000] [--workers 0,1,2] [--repeats 5] [--no-index]
                                     [--flip deferred|worker|none]
    .venv/bin/python bench/loader.py --source s3|http [--latency-ms 0,20,100] [--workers 1,2]
                                     [--cut-after 0,150000] [--piece-kib 1024]

On 112x112 JPEG shards generated in a temp dir. For each worker count N, each repeat times
bare decoding of the shards' own bytes (``decode_image``, the loader's decoder) in N forked
processes at once (in this process for N = 0), then the loader with N workers (images/s from
the first batch to the end of the epoch, so worker start-up is excluded). The ratio per
worker (loader img/s / N / bare img/s per process; the main process counts as the worker at
N = 0) is taken right after its own baseline, so the two sides see the same machine: on a
shared machine (Linux autogroups give a session one share of the CPU however many
processes it runs) N decoders get what N workers get. A second ratio divides images per
CPU-second of the workers (``os.times`` of the joined children; the main process's own at
N = 0) by the decoders' images per CPU-second: the work per image, which the load on a shared
machine hardly moves. A third, "steady", does the same from the first batch to the last but
one (the workers' CPU read from /proc): a worker's start (fork, page faults in its fresh
batch slots) costs it tens of milliseconds per epoch, a tenth of this short epoch and nothing
in a real one (about 90k images per worker per epoch for MS1M on 8 GPUs with 8 workers).
Prints the median and the range over the repeats, and the load average. ``--no-index``
deletes the shards' member indexes first, so the loader parses the tars (a folder converted
before indexes existed). ``--flip``: ``deferred`` (the default, as the trainer runs it: the
workers draw the flip bits and the engine mirrors on its device), ``worker`` (the workers
mirror: ``make_loader(flip=True)``) or ``none``.

``--source s3|http`` serves the same shards from a server on loopback (moto's S3 server or a
plain HTTP server, tools/remote_servers.py) behind a proxy that delays every request by each
of ``--latency-ms``, and times the loader reading them from the URL against the local loader
on the same folder in the same repeat (img/s per worker from the first batch on, and their
ratio), then a cache line: a second epoch read from a node-local cache (``data.cache_dir``)
filled by the first. With ``--cut-after`` the proxy also cuts every connection after each of
that many bytes (0: never), a link that kills long transfers, and the line says how many it
cut; ``--piece-kib``: the pieces a read asks for at a time (``Retry.piece_bytes``). The
servers run in this process, on the same CPUs as the workers. Never run by the tests.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/ is not installed

from data_pipeline import make_loader, read_manifest, write_synthetic_dataset  # noqa: E402
from data_pipeline.codec import decode_image, resolve_decoder  # noqa: E402
from data_pipeline.remote import Retry  # noqa: E402
from data_pipeline.remote_shards import Streaming  # noqa: E402
from data_pipeline.shard_index import index_path  # noqa: E402
from data_pipeline.tar_reader import tar_samples  # noqa: E402
from tools.remote_servers import (  # noqa: E402
    FaultProxy,
    FileServer,
    S3Server,
    clear_clients,
    upload,
)

FLIPS = {"deferred": "deferred", "worker": True, "none": False}  # --flip: make_loader's flip


class Rates(NamedTuple):
    wall: float  # images/s of wall time (per process or worker)
    cpu: float  # images per CPU-second of the decoding processes (the main process apart)
    steady: float  # the same from the first batch to the last (worker start and end apart)


def _decode_all(blobs: list[bytes], decoder: str) -> Rates:
    start, cpu = time.perf_counter(), time.process_time()
    for blob in blobs:
        decode_image(blob, 112, decoder)
    per_cpu_s = len(blobs) / (time.process_time() - cpu)
    return Rates(len(blobs) / (time.perf_counter() - start), per_cpu_s, per_cpu_s)


def bare_decode_rate(blobs: list[bytes], decoder: str, processes: int) -> Rates:
    """Per process, ``processes`` processes decoding at once (forked like the loader's
    workers, so they share the CPU as those do; 0: this process)."""
    if processes == 0:
        return _decode_all(blobs, decoder)
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        rates = pool.starmap(_decode_all, [(blobs, decoder)] * processes)
    return Rates(*(statistics.mean(r[i] for r in rates) for i in range(3)))


def _cpu(children: bool) -> float:
    t = os.times()
    return t.children_user + t.children_system if children else t.user + t.system


def _workers_cpu() -> float:
    """CPU-seconds so far of this process's live children (the DataLoader's workers), from
    /proc: ``os.times`` counts children only once they are joined."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for task in Path("/proc/self/task").iterdir():
        for pid in _proc_text(task / "children").split():
            stat = _proc_text(Path(f"/proc/{pid}/stat"))
            if stat:
                fields = stat.rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def _proc_text(path: Path) -> str:
    """A /proc file's text, or "" when its thread or process ended since the folder was
    listed (the servers' and the stores' client threads come and go)."""
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def loader_rate(data_dir: Path | str, workers: int, batch_size: int, decoder: str,
                flip: bool | str, streaming: Streaming | None = None, epoch: int = 0) -> Rates:
    """Wall images/s per worker from the first batch on (start-up excluded); images per
    CPU-second of the workers (all of them together) over the whole epoch, and from the first
    batch to the last but one (the workers' start and end apart, which a long epoch
    amortises); of this process at 0 workers."""
    epoch_cpu = _cpu(children=workers > 0)
    steady_cpu = _workers_cpu if workers else time.process_time
    loader = make_loader(data_dir, batch_size=batch_size, num_workers=workers, decoder=decoder,
                         flip=flip, streaming=streaming)
    loader.set_epoch(epoch)
    batches = iter(loader)
    next(batches)
    start, first_cpu = time.perf_counter(), steady_cpu()
    count = steady = 0
    for done, (_, labels, *_) in enumerate(batches, 2):
        count += len(labels)
        if done == len(loader) - 1:
            steady = count / (steady_cpu() - first_cpu)
    wall = count / (time.perf_counter() - start) / max(workers, 1)
    del batches  # the DataLoader joins its workers: their CPU time is then counted
    gc.collect()
    return Rates(wall, (count + batch_size) / (_cpu(children=workers > 0) - epoch_cpu), steady)


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
    parser.add_argument("--no-index", action="store_true",
                        help="read the shards without their member indexes")
    parser.add_argument("--flip", choices=sorted(FLIPS), default="deferred",
                        help="who mirrors: the engine on its device (the trainer's way), "
                             "the workers, or nobody")
    parser.add_argument("--source", choices=("local", "s3", "http"), default="local",
                        help="where the loader reads the shards: this folder, or a server on "
                             "loopback (compared with the local loader)")
    parser.add_argument("--latency-ms", default="0,20,100",
                        help="--source s3|http: comma-separated delays added to each request")
    parser.add_argument("--cut-after", default="0",
                        help="--source s3|http: comma-separated bytes after which the proxy "
                             "cuts every connection (0: never)")
    parser.add_argument("--piece-kib", type=int, default=Retry().piece_bytes >> 10,
                        help="--source s3|http: the pieces a read asks for at a time")
    args = parser.parse_args()
    decoder = resolve_decoder(args.decoder)
    counts = [int(w) for w in args.workers.split(",")]
    if args.source != "local":
        return remote(args, decoder, [w or 1 for w in counts])
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        write_synthetic_dataset(data, num_classes=args.images // 20, images_per_class=20,
                                samples_per_shard=1000)
        manifest = read_manifest(data)
        if args.no_index:
            for shard in manifest.shards:
                index_path(data / shard.name).unlink()
        blobs = [s["jpg"] for shard in manifest.shards for s in tar_samples(data / shard.name)]
        mean_kb = sum(map(len, blobs)) / len(blobs) / 1024
        print(f"{len(blobs)} JPEGs 112x112, mean {mean_kb:.1f} KiB, {os.cpu_count()} CPUs, "
              f"load average before {os.getloadavg()[0]:.2f}; decoder={decoder}, batch "
              f"{args.batch_size}, flip {args.flip}, shuffle buffer 1000, "
              f"{'no member index' if args.no_index else 'member index'}")
        bare, rates = {w: [] for w in counts}, {w: [] for w in counts}
        for _ in range(args.repeats):
            for w in counts:
                bare[w].append(bare_decode_rate(blobs, decoder, w))
                rates[w].append(loader_rate(data, w, args.batch_size, decoder,
                                            FLIPS[args.flip]))
        print(f"median [range] over {args.repeats} repeats; bare decode: that many processes "
              "decoding at once (0: in this one); img/s per worker (wall), img per CPU-second "
              "of the workers (the main process apart) over the epoch, and steady: from the "
              "first batch to the last but one")
        print(f"{'workers':>7}  {'bare img/s':>18}  {'loader img/s':>18}  {'wall / bare':>16}  "
              f"{'bare img/cpu-s':>18}  {'loader img/cpu-s':>18}  {'cpu / bare':>16}  "
              f"{'steady img/cpu-s':>18}  {'steady / bare':>16}")
        for w in counts:
            row = [f"{w:>7}"]
            for i in range(3):  # the bare decoders' steady rate is their CPU rate
                b, r = [x[i] for x in bare[w]], [x[i] for x in rates[w]]
                ratio = [x / y for x, y in zip(r, b, strict=True)]
                row += ([f"{_spread(b, '.0f'):>18}"] if i < 2 else []) + [
                    f"{_spread(r, '.0f'):>18}", f"{_spread(ratio, '.2f'):>16}"]
            print("  ".join(row))
        print(f"load average after {os.getloadavg()[0]:.2f}")


def remote(args, decoder: str, counts: list[int]) -> None:
    """``--source s3|http``: the loader from a URL against the local one, per latency."""
    flip = FLIPS[args.flip]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "set"
        write_synthetic_dataset(data, num_classes=args.images // 20, images_per_class=20,
                                samples_per_shard=1000)
        if args.source == "s3":
            server = S3Server()
            os.environ.update(server.environment(), AWS_EC2_METADATA_DISABLED="true")
            upload(data, "s3://bench/set")
            upstream, path = server.endpoint, "s3://bench/set"
        else:
            server = FileServer(Path(tmp))
            upstream, path = server.url, "/set"
        host, port = upstream.removeprefix("http://").split(":")
        print(f"{args.images} JPEGs 112x112 in shards of 1000, from {args.source} on loopback "
              f"vs the local folder, {os.cpu_count()} CPUs, load average before "
              f"{os.getloadavg()[0]:.2f}; decoder={decoder}, batch {args.batch_size}, flip "
              f"{args.flip}; median [range] over {args.repeats} repeats, img/s per worker")
        print(f"pieces of {args.piece_kib} KiB")
        print(f"{'latency':>8}  {'cut after':>9}  {'workers':>7}  {'local img/s':>18}  "
              f"{'remote img/s':>18}  {'remote / local':>16}")
        retry = Retry(piece_bytes=args.piece_kib << 10)
        try:
            for latency, cut in [(float(ms), int(cut)) for ms in args.latency_ms.split(",")
                                 for cut in args.cut_after.split(",")]:
                proxy = FaultProxy((host, int(port)), latency_s=latency / 1000,
                                   cut_after=cut or None)
                url = path if args.source == "s3" else proxy.url + path
                if args.source == "s3":
                    os.environ["AWS_ENDPOINT_URL"] = proxy.url
                    clear_clients()  # a cached client keeps the last proxy's address
                where = f"{latency:g} ms  {f'{cut:,} B' if cut else 'never':>9}"
                for w in counts:
                    local, far, cuts = [], [], proxy.cuts
                    for _ in range(args.repeats):
                        local.append(loader_rate(data, w, args.batch_size, decoder, flip).wall)
                        far.append(loader_rate(url, w, args.batch_size, decoder, flip,
                                               Streaming(retry=retry)).wall)
                    _remote_row(where, w, local, far, _cut(proxy.cuts - cuts, args.repeats))
                with tempfile.TemporaryDirectory() as cache:
                    streaming, cuts = Streaming(retry=retry, cache_dir=cache), proxy.cuts
                    loader_rate(url, counts[-1], args.batch_size, decoder, flip, streaming)
                    local, far = [], []
                    for epoch in range(1, args.repeats + 1):
                        local.append(loader_rate(data, counts[-1], args.batch_size, decoder,
                                                 flip, epoch=epoch).wall)
                        far.append(loader_rate(url, counts[-1], args.batch_size, decoder, flip,
                                               streaming, epoch).wall)
                    _remote_row(where, counts[-1], local, far,
                                "cached" + _cut(proxy.cuts - cuts, 1, " filling it"))
                proxy.close()
        finally:
            server.close()
        print(f"load average after {os.getloadavg()[0]:.2f}")


def _remote_row(where: str, workers: int, local: list[float], far: list[float],
                note: str = "") -> None:
    ratio = [f / n for f, n in zip(far, local, strict=True)]
    print(f"{where:>19}  {workers:>7}  {_spread(local, '.0f'):>18}  {_spread(far, '.0f'):>18}  "
          f"{_spread(ratio, '.2f'):>16}  {note}")


def _cut(cuts: int, epochs: int, during: str = "") -> str:
    """The note on the connections the proxy cut (none: nothing)."""
    return f"; {cuts / epochs:.0f} connections cut an epoch{during}" if cuts else ""


if __name__ == "__main__":
    main()
