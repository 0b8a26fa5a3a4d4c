"""What is alive at the CUDA allocator's peak during one head step, and where it was allocated.

Why: the planner's memory model (``partial_fc.memory.head_memory``) matches the CPU peak that
torch.profiler measures within 0.8-1.25x (``tests/offline/test_plan.py``), but the first GPU
run (2026-11-27, H200, torch 2.11) measured about 64 MiB more than the model at r = 1 and
r = 0.1 alike (``test_head_memory_on_cuda_within_factor``). This replays the allocator's
own trace of the measured step (after a warm-up step, as the test does) and prints the
blocks alive at its peak, largest first, each with the innermost frame of this repository
that asked for it, next to the model's gradient + working bytes.

    python bench/cuda_peak.py --rate 1.0      # the test's sizes: 200k classes, D 128, N 1024
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from partial_fc import PartialFC, SampledSGD, build_margin  # noqa: E402
from partial_fc.memory import head_memory  # noqa: E402

UPDATE = 64 << 20  # the optimizers' default max_update_bytes


def _where(frames: list[dict]) -> str:
    """``file:line function`` of the innermost frame in this repository (else torch's)."""
    for f in frames:
        path = Path(f["filename"])
        if path.is_relative_to(ROOT) and "site-packages" not in path.parts:
            return f"{path.relative_to(ROOT)}:{f['line']} {f['name']}"
    return f"{frames[0]['filename']}:{frames[0]['line']}" if frames else "?"


def live_at_peak(trace: list[dict]) -> tuple[int, list[tuple[int, str]]]:
    """Replay one device's allocator trace: the peak of bytes allocated within it and the
    ``(size, where)`` of each block alive then (blocks from before the trace are not seen)."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: list[tuple[int, str]] = []
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _where(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    return peak, sorted(at_peak, reverse=True)


def step_peak(head: PartialFC, opt: SampledSGD, emb: torch.Tensor, labels: torch.Tensor
              ) -> tuple[int, list[tuple[int, str]]]:
    """One engine-style head step after a warm-up step (state and cuBLAS workspaces exist):
    the allocator's peak minus what was allocated before it, and the blocks alive then
    (:func:`live_at_peak`). ``tests/offline/test_plan.py`` holds the peak to the model."""

    def step():
        head(emb.clone().requires_grad_(), labels).backward()
        opt.step(head.pop_sampled_rows())
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(stacks="python")
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return measured, live_at_peak(snapshot["device_traces"][torch.cuda.current_device()])[1]


def by_place(blocks: list[tuple[int, str]], most: int = 12) -> str:
    """The live blocks summed by where they were allocated, largest first, one per line."""
    sizes: Counter = Counter()
    for size, where in blocks:
        sizes[where] += size
    return "\n".join(f"  {size / (1 << 20):9.1f} MiB  {where}"
                     for where, size in sizes.most_common(most))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--classes", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("-N", type=int, default=1024)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--kernel", default="torch", help="the head's kernel (torch: modelled)")
    args = ap.parse_args()
    head = PartialFC(args.dim, args.classes, build_margin({"type": "arcface", "m": 0.5}),
                     sample_rate=args.rate, kernel=args.kernel, seed=0).cuda()
    opt = SampledSGD(head.weight, lr=0.1)
    emb = torch.randn(args.N, args.dim, device="cuda")
    labels = torch.randint(0, args.classes, (args.N,), device="cuda")
    measured, blocks = step_peak(head, opt, emb, labels)
    want = head_memory(args.classes, 1, args.dim, args.N, args.rate,
                       max_tile_bytes=head.max_tile_bytes, max_update_bytes=UPDATE)
    model = want.gradient + want.working
    print(f"rate {args.rate}: measured peak {measured / (1 << 20):.1f} MiB, model gradient + "
          f"working {model / (1 << 20):.1f} MiB, ratio {measured / model:.2f}")
    print(by_place(blocks))


if __name__ == "__main__":
    main()
