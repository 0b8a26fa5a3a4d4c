"""Benchmark: PartialFC vs the textbook full-softmax head, step time and peak memory per rank.

    python bench/head.py --classes 100000 --dim 512 --batch 128 --ranks 2 --sample-rate 0.1
    python bench/head.py --device cuda --ranks 8 --classes 2000000 --amp bf16   # NCCL

Each method runs in its own freshly spawned process group (gloo on CPU, NCCL on CUDA, one GPU
per rank), so peak figures do not mix:

- ``partialfc``: ``partial_fc.PartialFC`` with this rank's ``C/P`` rows, the global batch
  all-gathered, sampling rate ``r``;
- ``reference``: every rank holds the full ``[C, D]`` matrix (as DDP would), materialises
  logits ``[N, C]`` for its local batch with the same margin, ``F.cross_entropy``, and
  all-reduces the ``[C, D]`` weight gradient (DDP's averaging) when ``P > 1``.

Timed: forward + backward (and the reference's gradient all-reduce), median over ``--steps``
after ``--warmup``; optimizer steps are not timed. Memory: CUDA
``max_memory_allocated``; on CPU the growth of the process's peak RSS (``ru_maxrss``) over its
value before the head was built, a coarser figure. Prints figures, asserts nothing; not run
by the test suite.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from partial_fc import PartialFC, build_margin
from partial_fc.margins import MARGIN_TYPES

METHODS = ("partialfc", "reference")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _reference_step(weight, emb, labels, margin, s):
    """Full logits [n, C] with the margin on the target entries, F.cross_entropy, backward."""
    cos = (F.normalize(emb, dim=1) @ F.normalize(weight, dim=1).t()).float()
    rows = torch.arange(len(labels), device=emb.device)
    logits = (cos * s).index_put((rows, labels), margin.psi(cos[rows, labels], 0) * s)
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    if dist.get_world_size() > 1:  # what DDP does with a replicated classifier
        dist.all_reduce(weight.grad)
        weight.grad /= dist.get_world_size()
    return loss


def _peak_mib(device: torch.device, rss_before_kib: int) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kib) / 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(rank: int, args: argparse.Namespace, method: str, port: int, out) -> None:
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
        backend = "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ranks)
    margin = build_margin(dict(type=args.margin, s=args.scale))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if method == "partialfc":
        head = PartialFC(args.dim, args.classes, margin, sample_rate=args.sample_rate).to(device)
        params = head.weight
    else:
        margin = margin.to(device)
        params = torch.nn.Parameter(torch.randn(args.classes, args.dim, device=device) * 0.01)
    gen = torch.Generator(device=device).manual_seed(rank)
    times = []
    amp = dict(cuda=dict(device_type="cuda"), cpu=dict(device_type="cpu"))[device.type]
    for step in range(args.warmup + args.steps):
        emb = torch.randn(args.batch, args.dim, device=device, generator=gen, requires_grad=True)
        labels = torch.randint(0, args.classes, (args.batch,), device=device, generator=gen)
        params.grad = None
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        with torch.autocast(**amp, dtype=torch.bfloat16, enabled=args.amp == "bf16"):
            if method == "partialfc":
                head(emb, labels).backward()
            else:
                _reference_step(params, emb, labels, margin, args.scale)
        _sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    out.put((method, rank, 1e3 * statistics.median(times), _peak_mib(device, rss_before)))
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", "-C", type=int, default=100_000)
    parser.add_argument("--dim", "-D", type=int, default=512)
    parser.add_argument("--batch", "-N", type=int, default=128, help="per rank")
    parser.add_argument("--ranks", "-P", type=int, default=2)
    parser.add_argument("--sample-rate", "-r", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--margin", default="arcface",
                        choices=[t for t in MARGIN_TYPES if t != "adacos"])  # adacos: no --scale
    parser.add_argument("--scale", type=float, default=64.0)
    parser.add_argument("--amp", choices=("none", "bf16"), default="none")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 1:
        parser.error("--device cuda: no CUDA device visible")
    ctx = mp.get_context("spawn")
    rows = []
    for method in args.methods:
        out = ctx.SimpleQueue()
        mp.spawn(_worker, args=(args, method, _free_port(), out), nprocs=args.ranks)
        rows += sorted(out.get() for _ in range(args.ranks))
    print(f"C={args.classes} D={args.dim} N/rank={args.batch} P={args.ranks} "
          f"r={args.sample_rate} device={args.device} amp={args.amp} margin={args.margin}")
    print(f"{'method':<10} {'rank':>4} {'fwd+bwd ms':>11} {'peak MiB':>10}")
    for method, rank, ms, mib in rows:
        print(f"{method:<10} {rank:>4} {ms:>11.2f} {mib:>10.1f}")
    worst = {m: (max(r[2] for r in rows if r[0] == m), max(r[3] for r in rows if r[0] == m))
             for m in args.methods}
    if len(worst) == 2:
        (t_p, m_p), (t_r, m_r) = worst["partialfc"], worst["reference"]
        print(f"reference / partialfc (slowest rank): time {t_r / t_p:.2f}x, "
              f"peak memory {m_r / max(m_p, 1e-9):.2f}x")


if __name__ == "__main__":
    main()
