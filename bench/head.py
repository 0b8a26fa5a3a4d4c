"""Benchmark: PartialFC against a textbook sharded head, per rank: step time, extra peak memory.

    python bench/head.py -C 200000 -D 512 -N 64 -P 2                      # CPU, gloo
    python bench/head.py --device cuda -P 1 -C 1000000 -N 1024 --amp bf16  # one GPU = one rank
    python bench/head.py --insightface ~/src/insightface                   # + insightface's head
    python bench/head.py -P 1 -N 1024 -C 50000 --peers torch_lce           # + fused CE losses

Both heads run in the same freshly spawned process group (gloo on CPU, NCCL on CUDA, one GPU
per rank), on the same weight shard (``C/P`` rows per rank, the same sampled rows at ``r<1``)
and the same batches:

- ``ours``: ``partial_fc.PartialFC``, called as the trainer calls it (every rank's batch size
  and ``trusted_labels`` given: no metadata all-gather, no label range check);
- ``textbook``: the sharded head as a careful user writes it with autograd (insightface's
  ``PartialFC_V2`` structure): all-gather the normalised embeddings, full ``[N, C/P]`` cosines
  per rank, the margin on the target entries, and a sharded cross entropy (all-reduce MAX of
  the row max, SUM of the sum-exp and the target logit) that turns the logits into the softmax
  and then the gradient in place. Not a replicated classifier, which no one would run;
- ``insightface`` (``--insightface DIR``): insightface's own ``PartialFC_V2`` with its
  ``CombinedMarginLoss``, imported from the user's checkout (``DIR`` is the insightface
  repository or its ``recognition/arcface_torch``; nothing of it is vendored here), on the same
  shard rows and batches (at ``r<1`` it samples its own rows, the same number). On CPU its
  ``.cuda()`` calls are made no-ops in this process; its embedding gradient carries the world
  size factor its ``AllGatherFunc`` adds, which costs nothing;
- ``--peers torch_lce,cce,liger`` (``-P 1``, ``r = 1``): PyTorch's, Cut Cross-Entropy's and
  Liger's fused linear cross-entropy losses on ``s * normalize(e)`` and ``normalize(w)``, no
  margin (bench/head_peers.py; ``--skip-textbook`` leaves the textbook head out);
- ``matmuls``: only the three matmuls of a step at this rank's shapes (``E W^T``, ``G W``,
  ``G^T E``; ``N`` global rows, ``S`` sampled classes), the floor any head pays;
- ``sampler`` (``r<1``): only ours's class sampling of a step (``sample_classes`` on the
  global batch's labels), a part of ours's time.

Memory (measured first, one step at a time): the extra peak of a forward + backward over what
was alive before it (weights, batch), weight gradient included. CUDA: ``max_memory_allocated``
minus ``memory_allocated``. CPU: glibc's ``M_MMAP_THRESHOLD`` is fixed at 64 KiB (``mallopt``,
which also stops its dynamic growth), so every tensor is its own mapping, returned to the OS
when freed; the peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) minus
the resident set before the step is then the peak of live bytes, reproducible to a few pages.

Time (measured after, with a caching heap as a GPU allocator has: on CPU ``mallopt`` turns
``mmap`` off and trimming off, so freed blocks are reused, not faulted in again each step):
forward + backward, the two heads interleaved step by step so machine load hits both alike;
per step the slowest rank counts. Printed: median and [min, max] over ``--steps`` steps, the
median of the per-step ratio ours / textbook (robust to load that drifts between steps), the
spread of the per-rank extra peaks, and classes per GB = ``C/P`` over (weight + extra peak).
Host reads: the reads of device values by the host in one step of each head (after its
warm-up), counted as ``tests/host_reads.py`` counts them (``TorchFunctionMode``; on CPU too):
on a GPU each one stalls the launch queue until the device drains.
Prints figures, asserts nothing; not run by the test suite.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from partial_fc import PartialFC, build_margin
from partial_fc import distributed as dist_ops
from partial_fc.margins.registry import MARGIN_TYPES
from partial_fc.sampling import sample_classes, sample_size
from partial_fc.tiles import KERNELS
from trainer.host_heap import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, glibc_mallopt, keep_freed_blocks

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ holds scripts, no package
import head_peers  # noqa: E402

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TESTS = Path(__file__).resolve().parent.parent / "tests"  # host_reads.py: the tests' counter


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Clock:
    """Wall time of a region: CUDA events on a GPU, perf_counter after a barrier on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.begin = torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.begin = time.perf_counter()

    def stop_ms(self) -> float:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return self.begin.elapsed_time(end)
        return 1e3 * (time.perf_counter() - self.begin)


class _Memory:
    """Extra peak bytes of a region over what was alive when it began (see module doc)."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cpu":
            self.libc = ctypes.CDLL("libc.so.6")  # malloc_trim below
            mallopt = glibc_mallopt()
            mallopt(M_MMAP_THRESHOLD, 64 << 10)
            mallopt(M_TRIM_THRESHOLD, 0)

    def caching_heap(self) -> None:
        """After the memory steps: keep freed blocks for reuse (what the timed steps get)."""
        if self.device.type == "cpu":
            keep_freed_blocks()

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        self.libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        self.base = self._status("VmRSS")

    def stop_bytes(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return self._status("VmHWM") - self.base

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {key}")


def _step(head, emb, labels, amp, **known) -> None:
    x = emb.detach().requires_grad_()
    with torch.autocast(**amp):
        loss = head(x, labels.clone(), **known)  # insightface's head writes into its labels
    loss.backward()


def _timed(clock: _Clock, steps: int, work: Callable[[int], object]) -> list[float]:
    """The ms of ``work(step)`` for ``steps`` steps after one untimed warm-up call."""
    out = []
    for step in range(steps + 1):
        clock.start()
        work(step)
        out.append(clock.stop_ms())
    return out[1:]


def _matmuls(n: int, s: int, d: int, device, dtype, clock: _Clock, steps: int) -> list[float]:
    e, g = (torch.randn(n, d, device=device, dtype=dtype),
            torch.randn(n, s, device=device, dtype=dtype))
    w = torch.randn(s, d, device=device, dtype=dtype)
    return _timed(clock, steps, lambda _: (e @ w.t(), g @ w, g.t() @ e))


def _sampler(ours: PartialFC, labels: torch.Tensor, clock: _Clock, steps: int) -> list[float]:
    return _timed(clock, steps, lambda step: sample_classes(
        labels, ours.class_start, ours.num_local, ours.sample_rate, ours.seed, step, ours.rank))


def _worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
        backend = "gloo"
    memory, clock = _Memory(device), _Clock(device)
    sys.path.insert(0, str(TESTS))
    from host_reads import HostReads
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ranks)
    margin = build_margin(dict(type=args.margin, s=args.scale))
    tile = {} if args.max_tile_mib is None else {"max_tile_bytes": args.max_tile_mib << 20}
    ours = PartialFC(args.dim, args.classes, margin, sample_rate=args.sample_rate,
                     kernel=args.kernel, state_dtype=STATE_DTYPES[args.state_dtype],
                     **tile).to(device)
    heads = {"ours": ours}
    if not args.skip_textbook:
        heads["textbook"] = head_peers.Textbook(ours).to(device)
    if args.insightface:
        heads["insightface"] = head_peers.insightface_head(args.insightface, ours.weight, args,
                                                           device)
    peers, missing = head_peers.build(args.peers, ours.weight, args.scale)
    heads.update((name, peer.to(device)) for name, peer in peers.items())
    for note in missing if rank == 0 else []:
        print(note, flush=True)
    gen = torch.Generator(device=device).manual_seed(rank)
    batches = [(torch.randn(args.batch, args.dim, device=device, generator=gen),
                torch.randint(0, args.classes, (args.batch,), device=device, generator=gen))
               for _ in range(2)]
    amp = dict(device_type=device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16")
    result = {"mem": {}, "ms": {name: [] for name in heads}, "reads": {}}
    known = {"ours": dict(sizes=[args.batch] * args.ranks, trusted_labels=True)}

    def step(name, i):
        _step(heads[name], *batches[i % 2], amp, **known.get(name, {}))

    def prepare(name, i):
        """The textbook reuses the rows ours samples (ours runs first); no gradient alive;
        ours's rows popped, as a training loop pops them for its optimizer every step."""
        ours.pop_sampled_rows()
        if name == "textbook":
            step("ours", i)
        for head in heads.values():
            head.weight.grad = None

    for name in heads:
        prepare(name, 0)
        step(name, 0)  # warm up
        for note in ours.take_notes() if name == "ours" and rank == 0 else []:
            print(note, flush=True)  # e.g. the kernels' configuration and where it came from
        peaks = []
        for i in range(args.mem_steps):
            prepare(name, i)
            memory.start()
            step(name, i)
            peaks.append(memory.stop_bytes())
        result["mem"][name] = peaks
        prepare(name, 1)
        with HostReads() as reads:
            step(name, 1)
        result["reads"][name] = len(reads)
    memory.caching_heap()
    for i in range(args.warmup + args.steps):
        for name in heads:
            prepare(name, i)
            dist.barrier()
            clock.start()
            step(name, i)
            if i >= args.warmup:
                result["ms"][name].append(clock.stop_ms())
    sampled = sample_size(args.sample_rate, ours.num_local)
    dtype = torch.bfloat16 if args.amp == "bf16" else torch.float32
    result["ms"]["matmuls"] = _matmuls(args.batch * args.ranks, sampled, args.dim, device,
                                       dtype, clock, args.steps)
    if args.sample_rate < 1:
        labels = dist_ops.all_gather(batches[0][1], ours.process_group)
        result["ms"]["sampler"] = _sampler(ours, labels, clock, args.steps)
    result["weight_bytes"] = ours.weight.numel() * ours.weight.element_size()
    result["num_local"] = ours.num_local
    queue.put((rank, result))
    dist.destroy_process_group()
    os._exit(0)


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):9.2f} [{min(values):.2f}, {max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", "-C", type=int, default=200_000)
    parser.add_argument("--dim", "-D", type=int, default=512)
    parser.add_argument("--batch", "-N", type=int, default=64, help="per rank")
    parser.add_argument("--ranks", "-P", type=int, default=2)
    parser.add_argument("--sample-rate", "-r", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per head")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--mem-steps", type=int, default=3, help="memory steps per head")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--margin", default="arcface",
                        choices=[t for t in MARGIN_TYPES if t != "adacos"])  # adacos: no --scale
    parser.add_argument("--scale", type=float, default=64.0)
    parser.add_argument("--amp", choices=("none", "bf16"), default="none")
    parser.add_argument("--kernel", choices=KERNELS, default="auto", help="PartialFC's backend")
    parser.add_argument("--state-dtype", choices=sorted(STATE_DTYPES), default="fp32",
                        help="PartialFC's weight dtype (the textbook head gets the same rows)")
    parser.add_argument("--insightface", metavar="DIR", default=None,
                        help="an insightface checkout: time its PartialFC_V2 as a fourth head")
    parser.add_argument("--peers", default="", metavar="NAMES",
                        help="comma-separated fused CE losses to time beside ours, no margin: "
                        f"{', '.join(head_peers.PEERS)} (-P 1, r = 1; bench/head_peers.py)")
    parser.add_argument("--skip-textbook", action="store_true",
                        help="leave the textbook head out (its rows are timed elsewhere)")
    parser.add_argument("--max-tile-mib", type=int, default=None,
                        help="PartialFC's max_tile_bytes in MiB (default: PartialFC's)")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 1:
        parser.error("--device cuda: no CUDA device visible")
    if args.insightface and args.margin not in head_peers.INSIGHTFACE_MARGINS:
        parser.error(f"--insightface: --margin {args.margin} has no CombinedMarginLoss "
                     f"equivalent here (use {', '.join(head_peers.INSIGHTFACE_MARGINS)})")
    try:
        args.peers = head_peers.names(args.peers, args.device)
    except ValueError as err:
        parser.error(str(err))
    if args.peers and (args.ranks != 1 or args.sample_rate != 1):
        parser.error("--peers: one process and r = 1 only (-P 1 -r 1): no peer shards or "
                     "samples the classes")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(args, _free_port(), queue), nprocs=args.ranks)
    results = [r for _, r in sorted(queue.get() for _ in range(args.ranks))]
    slowest = {name: [max(step) for step in zip(*(r["ms"][name] for r in results), strict=True)]
               for name in results[0]["ms"]}
    gib = 2**30
    print(f"C={args.classes} D={args.dim} N/rank={args.batch} P={args.ranks} "
          f"r={args.sample_rate} device={args.device} amp={args.amp} margin={args.margin} "
          f"kernel={args.kernel} state={args.state_dtype} "
          f"max_tile_mib={args.max_tile_mib or 'default'} "
          f"steps={args.steps} (slowest rank per step; extra peak over ranks and steps)")
    print(f"{'':<9} {'fwd+bwd ms, median [min, max]':>30} {'extra peak MiB [min, max]':>28} "
          f"{'classes/GB':>11} {'host reads':>10}")
    for name, times in slowest.items():
        if name in ("matmuls", "sampler"):
            print(f"{name:<9} {_fmt(times):>30}")
            continue
        peaks = [p for r in results for p in r["mem"][name]]
        per_gb = min(r["num_local"] / ((r["weight_bytes"] + max(r["mem"][name])) / 1e9)
                     for r in results)
        print(f"{name:<9} {_fmt(times):>30} {max(peaks) / 2**20:>11.1f} "
              f"[{min(peaks) / 2**20:.1f}, {max(peaks) / 2**20:.1f}] {per_gb:>11.0f} "
              f"{max(r['reads'][name] for r in results):>10}")
    med = {name: statistics.median(times) for name, times in slowest.items()}
    peak = {name: max(p for r in results for p in r["mem"][name]) for name in results[0]["mem"]}
    for peer in peak.keys() - {"ours"}:
        paired = [o / t for o, t in zip(slowest["ours"], slowest[peer], strict=True)]
        print(f"ours / {peer}: time {med['ours'] / med[peer]:.2f}x (per interleaved step: "
              f"median {statistics.median(paired):.2f}x [{min(paired):.2f}, "
              f"{max(paired):.2f}]), extra peak {peak['ours'] / max(peak[peer], 1):.2f}x; "
              f"it takes {med[peer] / med['matmuls']:.2f}x the matmuls")
    print(f"ours takes {med['ours'] / med['matmuls']:.2f}x the matmuls; "
          f"weight {results[0]['weight_bytes'] / gib:.3f} GiB/rank")


if __name__ == "__main__":
    main()
