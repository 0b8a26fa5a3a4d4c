"""Benchmark: the Triton class-tile kernels vs the three matmuls they cannot beat (CUDA only).

    python bench/kernels.py                                   # N=1024, D=512, S=1M and 100k, bf16
    python bench/kernels.py --classes 4000000 --dtype float32

For each class count ``S`` (one rank's sampled rows, ``C_local * r``) it times, with
``triton.testing.do_bench`` (median of ``--rep`` ms after ``--warmup`` ms):

- ``stats``: ``class_tile_stats`` (forward: one ``[N, S]`` matmul recomputed tile by tile);
- ``grads``: ``class_tile_grads`` (backward: per class chunk, one kernel recomputing the
  cosines into ``G'`` and two GEMMs);
- ``matmuls``: ``E W^T`` ``[N, S]``, ``G W`` ``[N, D]`` and ``G^T E`` ``[S, D]`` with cuBLAS
  (``G`` a precomputed ``[N, S]`` tensor of the operand dtype): the GEMM floor of any head;
- ``torch``: the same two passes by ``partial_fc.tiles.reference`` (PyTorch, fp32 products),
  chunked to 256 MiB fp32 tiles;

and prints the kernels' total, the share ``matmuls / (stats + grads)`` and each call's extra
peak memory (``max_memory_allocated`` minus allocated before; the ``[N, S]`` ``G`` of the
matmul baseline is excluded from its figure).

Registers, spills and shared memory without a GPU: ``make kernels-aot``
(``tools/kernels_aot.py``).

Prints figures, asserts nothing; not run by the test suite. ``docs/kernels.md`` explains the
floors.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _extra_peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def _case(n: int, s_cols: int, d: int, dtype: torch.dtype, args) -> None:
    import triton.testing

    from partial_fc.tiles.reference import ReferenceTiles, chunk_columns
    from partial_fc.tiles.triton import class_tile_grads, class_tile_stats

    g = torch.Generator(device="cuda").manual_seed(0)
    e = F.normalize(torch.randn(n, d, device="cuda", generator=g), dim=1).to(dtype)
    w = (torch.randn(s_cols, d, device="cuda", generator=g) * 0.01).to(dtype)
    inv = 1.0 / w.float().norm(dim=1)
    tgt = torch.randint(0, s_cols, (n,), device="cuda", generator=g)
    scale = 64.0
    row_max, row_sum, _ = class_tile_stats(e, w, inv, tgt, scale)
    lse = row_max + torch.log(row_sum)  # as if the targets' logits were negligible
    coef = torch.full((n,), scale / n, device="cuda")
    tgrad = torch.full((n,), -scale / n, device="cuda")

    def stats():
        return class_tile_stats(e, w, inv, tgt, scale)

    def grads():
        return class_tile_grads(e, w, inv, tgt, scale, lse, coef, tgrad)

    reference = ReferenceTiles(256 << 20)  # the kernels' G' budget, as fp32 columns
    chunk = chunk_columns(n, reference.max_tile_bytes)

    def torch_path():
        reference.class_tile_stats(e, w, inv, tgt, scale)
        return reference.class_tile_grads(e, w, inv, tgt, scale, lse, coef, tgrad)

    grad_cos = torch.randn(n, s_cols, device="cuda", generator=g).to(dtype)

    def matmuls():
        return e @ w.T, grad_cos @ w, grad_cos.T @ e

    runs = (("stats", stats), ("grads", grads), ("matmuls", matmuls), ("torch", torch_path))
    times = {name: triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep,
                                           return_mode="median") for name, fn in runs}
    peaks = {name: _extra_peak_gib(fn) for name, fn in runs}
    total = times["stats"] + times["grads"]
    tflop = 3 * 2 * n * s_cols * d / 1e12
    print(f"N={n} S={s_cols} D={d} {str(dtype).removeprefix('torch.')}:  "
          f"stats {times['stats']:.3f} ms ({peaks['stats']:.2f} GiB)  "
          f"grads {times['grads']:.3f} ms ({peaks['grads']:.2f} GiB)  "
          f"kernels {total:.3f} ms  |  3 matmuls {times['matmuls']:.3f} ms "
          f"({tflop / times['matmuls'] * 1e3:.0f} TFLOP/s, {peaks['matmuls']:.2f} GiB)  "
          f"share {times['matmuls'] / total:.2f}  |  PyTorch chunked path {times['torch']:.3f} ms "
          f"({peaks['torch']:.2f} GiB, chunk {chunk})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1024, help="N, the global batch")
    parser.add_argument("--classes", type=int, nargs="+", default=[1_000_000, 100_000],
                        help="S, this rank's (sampled) classes; one line per value")
    parser.add_argument("--dim", type=int, default=512, help="D")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    parser.add_argument("--rep", type=int, default=200, help="do_bench measuring time, ms")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA device: the kernels are compiled Triton (on CPU "
                 "only triton's interpreter runs them, for tests/partial_fc/test_tiles.py)")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for s_cols in args.classes:
        _case(args.batch, s_cols, args.dim, DTYPES[args.dtype], args)


if __name__ == "__main__":
    main()
