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
- ``torch``: the same two passes by ``partial_fc.chunked`` (PyTorch, fp32 products), chunked
  to 256 MiB fp32 tiles;

and prints the kernels' total, the share ``matmuls / (stats + grads)`` and each call's extra
peak memory (``max_memory_allocated`` minus allocated before; the ``[N, S]`` ``G`` of the
matmul baseline is excluded from its figure).

``--ptxas 90`` needs no GPU: it compiles every kernel for that compute capability at the CUDA
tiles (``partial_fc.kernels.triton_margin.cuda_tiles``), with the divisibility hints a launch at
``--batch``/``--dim`` gets, and prints ptxas' registers and spill stack per thread, shared
memory, tensor-core instructions and the loads software-pipelined into shared memory.

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


def _ptxas_report(arch: int, dtype: torch.dtype) -> None:
    """Static resource usage of each kernel as launched on CUDA (no device needed)."""
    import os
    import subprocess

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    from partial_fc.kernels import triton_margin as tm

    t = tm.cuda_tiles(sms=132)
    op = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]
    op_name = {tl.bfloat16: "bf16", tl.float16: "fp16", tl.float32: "fp32"}[op]
    dtypes = {"E": op_name, "W": op_name, "G_OUT": op_name, "A": op_name, "B": op_name,
              "TGT": "i64"}
    common = dict(OP=op, DOT=op, SOFT_BF16=False,
                  PRECISION="ieee" if dtype == torch.float32 else "tf32")
    cos = dict(BLOCK_N=t.rows, BLOCK_S=t.cols, BLOCK_D=t.depth, **common)
    gemm = dict(BLOCK_M=t.gemm, BLOCK_NC=t.gemm, BLOCK_K=t.depth, **common)
    kernels = {
        "stats": (tm._stats_kernel, cos),
        "dcos": (tm._dcos_kernel, cos),
        "gemm grad_e": (tm._gemm_kernel, dict(gemm, PROJECT=False, stride_ak=1, stride_bn=1)),
        "gemm grad_w": (tm._gemm_kernel, dict(gemm, PROJECT=True, stride_am=1, stride_bn=1)),
    }
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    print(f"sm_{arch}, {dtype}, tiles {t}")
    for name, (kernel, constexprs) in kernels.items():
        sig, attrs = {}, {}
        for i, arg in enumerate(kernel.arg_names):
            if arg in constexprs:
                sig[arg] = "constexpr"
            elif arg.isupper() and arg not in ("N", "S", "D", "M", "NC", "K"):  # pointers
                sig[arg] = "*" + dtypes.get(arg, "fp32")
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:  # sizes and strides at N=1024, D=512 are multiples of 16, split counts not
                sig[arg] = "i32"
                if arg not in ("tiles_per_split",):
                    attrs[(i,)] = [["tt.divisibility", 16]]
        src = triton.compiler.ASTSource(kernel, sig, constexprs, attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=t.num_warps, num_stages=t.num_stages))
        with open(f"/tmp/partial_fc_{kernel.__name__}.cubin", "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout.strip().splitlines()[-1].split()
        ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
        print(f"  {name:12s} {usage[0]} {usage[1]} (bytes/thread spilled) "
              f"smem {compiled.metadata.shared} B, wgmma {ptx.count('wgmma.mma_async')}, "
              f"mma.sync {ptx.count('mma.sync')}, "
              f"pipelined loads {ttgir.count('async_copy_global_to_local')}")


def _case(n: int, s_cols: int, d: int, dtype: torch.dtype, args) -> None:
    import triton.testing

    from partial_fc import chunked
    from partial_fc.kernels.triton_margin import class_tile_grads, class_tile_stats

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

    chunk = chunked.chunk_columns(n, 256 << 20)  # the kernels' G' budget, as fp32 columns

    def torch_path():
        chunked.class_tile_stats(e, w, inv, tgt, scale, chunk)
        return chunked.class_tile_grads(e, w, inv, tgt, scale, lse, coef, tgrad, chunk)

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
    parser.add_argument("--ptxas", type=int, metavar="SM", default=None,
                        help="no GPU needed: compile for compute capability SM (e.g. 90) and "
                             "print registers, spills and pipelining instead of timing")
    args = parser.parse_args(argv)
    if args.ptxas is not None:
        _ptxas_report(args.ptxas, DTYPES[args.dtype])
        return
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA device: the kernels are compiled Triton (on CPU "
                 "only triton's interpreter runs them, for tests/partial_fc/test_triton_margin.py)")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for s_cols in args.classes:
        _case(args.batch, s_cols, args.dim, DTYPES[args.dtype], args)


if __name__ == "__main__":
    main()
