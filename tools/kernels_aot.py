"""``python -m tools.kernels_aot`` (``make kernels-aot``): every Triton kernel the head can
launch, compiled ahead of time for sm_80 and sm_90 on a machine without a GPU.

The interpreter tests (``TRITON_INTERPRET=1``) never compile anything, so a kernel that does
not compile for a GPU, spills, or asks for more shared memory than a block may have would pass
them. This compiles each launch of ``partial_fc.tiles.triton`` with the constexprs the
launcher picks (``operand_constexprs``, ``cuda_tiles``) for every operand combination the head
can hand it, with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` (the
triton wheel ships ptxas), and reads registers and spills (``cuobjdump -res-usage``: STACK is
the per-thread local frame spills go to) and shared memory from the cubin. Sampled and
unsampled heads launch the same kernels: the sampled rows are just a smaller ``w``.

Alignment: triton specialises every integer argument that is a multiple of 16 at launch. The
embedding size D (512) and the strides derived from it always are; the sizes that count this
rank's classes (S, a backward chunk's width) are compiled without the hint, since any class
count can reach them; the global batch N is compiled both ways (``aligned``: N a multiple of
16, as 1024 is; not: e.g. N = 1000).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

# Per-block shared memory limits (opt-in maximum) and per-SM resources, CUDA C Programming
# Guide, "Technical Specifications per Compute Capability".
DEVICES = {
    80: dict(name="A100", smem_per_block=163 * 1024, smem_per_sm=164 * 1024),
    90: dict(name="H100", smem_per_block=227 * 1024, smem_per_sm=228 * 1024),
}
REGS_PER_SM, MAX_WARPS_PER_SM, MAX_BLOCKS_PER_SM, REG_ALLOC_UNIT = 65536, 64, 32, 256

# The operand combinations the head can pass (e dtype, w dtype, fp32 dots exact): a bf16 run
# (bf16 e) with fp32 or bf16 state is the default; an fp32 run keeps fp32 e, exact or TF32;
# fp16 is accepted by the kernels' API.
OPERANDS = {
    "bf16 e, fp32 w": (torch.bfloat16, torch.float32, True),
    "bf16 e, bf16 w": (torch.bfloat16, torch.bfloat16, True),
    "fp32 e, bf16 w": (torch.float32, torch.bfloat16, True),
    "fp32 e, fp32 w, ieee": (torch.float32, torch.float32, True),
    "fp32 e, fp32 w, tf32": (torch.float32, torch.float32, False),
    "fp16 e, fp16 w": (torch.float16, torch.float16, True),
}
DEFAULT_OPERANDS = ("bf16 e, fp32 w", "bf16 e, bf16 w")  # what a bf16 run launches
TL_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
SIZES = {"N", "S", "D", "M", "NC", "K"}  # the other upper-case arguments are pointers
FLOATS = {"tau"}  # the lower-case arguments that are fp32 scalars, not integers


@dataclass(frozen=True)
class Row:
    kernel: str
    operands: str
    aligned: bool
    arch: int
    registers: int
    spill_bytes: int  # per thread (cuobjdump STACK)
    shared_bytes: int
    num_warps: int
    num_stages: int

    @property
    def default(self) -> bool:
        return self.operands in DEFAULT_OPERANDS

    def occupancy(self) -> float:
        """Active warps / 64 per SM, limited by registers, shared memory and blocks."""
        dev = DEVICES[self.arch]
        regs_per_warp = -(-self.registers * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
        by_regs = REGS_PER_SM // (regs_per_warp * self.num_warps)
        by_smem = dev["smem_per_sm"] // max(1, self.shared_bytes)
        by_warps = MAX_WARPS_PER_SM // self.num_warps
        blocks = min(by_regs, by_smem, by_warps, MAX_BLOCKS_PER_SM)
        return blocks * self.num_warps / MAX_WARPS_PER_SM

    def problems(self) -> list[str]:
        """What the suite refuses: shared memory over the block limit; spills by default."""
        out = []
        limit = DEVICES[self.arch]["smem_per_block"]
        if self.shared_bytes > limit:
            out.append(f"shared memory {self.shared_bytes} B > {limit} B per block")
        if self.default and self.spill_bytes:
            out.append(f"spills {self.spill_bytes} B/thread in a default configuration")
        return out


@dataclass(frozen=True)
class Launch:
    kernel: object  # the @triton.jit function
    constexprs: dict
    pointers: dict[str, str]  # pointer argument -> element type (the rest are fp32)
    batch_sized: tuple[str, ...]  # integer arguments equal to N
    class_sized: tuple[str, ...]  # integer arguments that count classes


def transforms() -> dict[str, dict]:
    """The non-target transforms a head can hand the kernels (``partial_fc.nontarget``), by
    the suffix of their launches' names, as ``nontarget_constexprs`` gives their constexprs:
    none, AdaFace's clamp, the inter-class filter (on any margin, so also with the clamp),
    CurricularFace's modulation (with or without the filter)."""
    from partial_fc.margins.adaface import EPS
    from partial_fc.nontarget import NonTarget
    from partial_fc.tiles import triton as tm

    hard = dict(hard_above=torch.zeros(1), t=torch.zeros(()))
    # "inter-class filter", not "filtered": the filtered backward (skip) is another thing.
    steps = {"": None, ", clamped": NonTarget(clamp=EPS),
             ", inter-class filter": NonTarget(tau=0.4),
             ", clamped, inter-class filter": NonTarget(clamp=EPS, tau=0.4),
             ", curricular": NonTarget(**hard),
             ", curricular, inter-class filter": NonTarget(tau=0.4, **hard)}
    return {suffix: tm.nontarget_constexprs(step) for suffix, step in steps.items()}


def launches(operands: str, tiles=None) -> dict[str, Launch]:
    """The launches of ``class_tile_stats`` and ``class_tile_grads`` on CUDA for this operand
    combination, with the constexprs they pass: the two GEMMs, and the stats and ``G'``
    kernels with each non-target transform (:func:`transforms`); ``tiles`` (a
    ``partial_fc.tiles.triton.Tiles``) default to ``cuda_tiles``."""
    from partial_fc.tiles import triton as tm

    e_dtype, w_dtype, exact = OPERANDS[operands]
    op, consts = tm.operand_constexprs(e_dtype, w_dtype, widen=False, fp32_exact=exact)
    t = tiles or tm.cuda_tiles(sms=132)
    e, w, g = TL_NAMES[e_dtype], TL_NAMES[w_dtype], TL_NAMES[op]
    cos = dict(BLOCK_N=t.rows, BLOCK_S=t.cols, BLOCK_D=t.depth, **consts)
    gemm = dict(BLOCK_M=t.gemm, BLOCK_NC=t.gemm, BLOCK_K=t.depth, SKIP=False, **consts)
    out = {}
    for suffix, transform in transforms().items():
        out["stats" + suffix] = Launch(tm._stats_kernel, dict(cos, **transform),
                                       dict(E=e, W=w, TGT="i64"), ("N",),
                                       ("S", "tiles_per_split"))
        out["dcos" + suffix] = Launch(tm._dcos_kernel, dict(cos, SKIP=False, **transform),
                                      dict(E=e, W=w, TGT="i64", G_OUT=g, LIVE_OUT="i32"),
                                      ("N",), ("width",))
    return out | {  # grad_e: part = G' W_chunk; grad_w: G'^T E - inv^2 r w, rounded to w's dtype
        "gemm grad_e": Launch(tm._gemm_kernel, dict(gemm, PROJECT=False, ROUND_OUT=False,
                                                     stride_ak=1, stride_bn=1),
                              dict(A=g, B=w, W=w, LIVE="i32"), ("M",), ("K", "k_per_split")),
        "gemm grad_w": Launch(tm._gemm_kernel, dict(gemm, PROJECT=True,
                                                     ROUND_OUT=w_dtype != torch.float32,
                                                     stride_am=1, stride_bn=1),
                              dict(A=g, B=e, OUT=w, W=w, LIVE="i32"), ("K", "k_per_split"),
                              ("M",)),
    }


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")


def compile_one(launch: Launch, arch: int, aligned: bool, num_warps: int,
                num_stages: int) -> tuple[int, int, int]:
    """``(registers, spill bytes per thread, shared bytes)`` of one compiled launch."""
    import triton
    from triton.backends.compiler import GPUTarget

    from partial_fc.tiles.triton import FP_FUSION

    unhinted = set(launch.class_sized) | (set() if aligned else set(launch.batch_sized))
    signature, attrs = {}, {}
    for i, param in enumerate(launch.kernel.params):
        name = param.name
        if name in launch.constexprs:
            signature[name] = "constexpr"
            continue
        pointer = name.isupper() and name not in SIZES
        if name in FLOATS:
            signature[name] = "fp32"
            continue
        signature[name] = "*" + launch.pointers.get(name, "fp32") if pointer else "i32"
        if name not in unhinted:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(launch.kernel, signature, launch.constexprs, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages,
                                           enable_fp_fusion=FP_FUSION))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([_cuobjdump(), "-res-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    fields = dict(f.split(":", 1) for f in usage.split() if ":" in f and f[0].isupper())
    return int(fields["REG"]), int(fields["STACK"]), int(compiled.metadata.shared)


@functools.cache
def compile_row(kernel: str, operands: str, aligned: bool, arch: int) -> Row:
    from partial_fc.tiles import triton as tm

    t = tm.cuda_tiles(sms=132)
    regs, spill, shared = compile_one(launches(operands)[kernel], arch, aligned, t.num_warps,
                                      t.num_stages)
    return Row(kernel, operands, aligned, arch, regs, spill, shared, t.num_warps, t.num_stages)


def table(rows: list[Row]) -> str:
    """Markdown: one line per compiled launch."""
    lines = ["| kernel | operands | aligned | target | registers | spill (B/thread) | "
             "shared memory | warps x stages | occupancy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        flag = " (default)" if r.default else ""
        lines.append(f"| `{r.kernel}` | {r.operands}{flag} | {'yes' if r.aligned else 'no'} | "
                     f"sm_{r.arch} | {r.registers} | {r.spill_bytes} | "
                     f"{r.shared_bytes / 1024:.0f} KiB | {r.num_warps} x {r.num_stages} | "
                     f"{r.occupancy():.0%} |")
    return "\n".join(lines)


def all_rows() -> list[Row]:
    return [compile_row(kernel, operands, aligned, arch)
            for arch in DEVICES for operands in OPERANDS
            for kernel in launches(operands) for aligned in (True, False)]


def candidate_rows() -> list[tuple[str, Row]]:
    """The tuner's other Triton candidates (``partial_fc.tiles.tuning.candidates``) where each
    is offered (sm_80: capability 8.0, sm_90: 9.0), compiled as the default configurations
    are checked: bf16 operands, N aligned, no non-target transform; each row with its tiles
    in words (``rows x cols x depth, GEMM gemm``)."""
    from partial_fc.tiles import autotune, tuning

    out = []
    for arch in DEVICES:
        for choice in tuning.candidates(divmod(arch, 10)):
            if choice.engine != "triton" or choice == tuning.DEFAULT:
                continue
            t = autotune.as_tiles(choice, 132)
            name = f"{t.rows}x{t.cols}x{t.depth}, GEMM {t.gemm}"
            for operands in DEFAULT_OPERANDS:
                for kernel, launch in launches(operands, t).items():
                    if ", " not in kernel:
                        regs, spill, shared = compile_one(launch, arch, True, t.num_warps,
                                                          t.num_stages)
                        out.append((name, Row(kernel, operands, True, arch, regs, spill,
                                              shared, t.num_warps, t.num_stages)))
    return out


def write_doc(doc: Path, rows: list[Row]) -> None:
    """Replace the generated section of ``doc`` (between its two marker lines)."""
    import triton

    begin, end = "<!-- kernels-aot: begin -->", "<!-- kernels-aot: end -->"
    text = doc.read_text()
    head, rest = text.split(begin) if begin in text else (text.rstrip() + "\n\n", end)
    body = (f"{begin}\n`make kernels-aot` (`python -m tools.kernels_aot`), triton "
            f"{triton.__version__}, torch {torch.__version__.split('+')[0]}; no GPU involved.\n\n"
            f"{table(rows)}\n")
    doc.write_text(head + body + end + rest.split(end, 1)[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.kernels_aot",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc", type=Path, default=Path("docs/kernels.md"),
                        help="markdown file whose generated section receives the table")
    parser.add_argument("--no-doc", action="store_true", help="print only")
    parser.add_argument("--candidates", action="store_true", help="the tuner's other "
                        "candidates instead (printed only): they must not spill either")
    args = parser.parse_args(argv)
    if args.candidates:
        found = candidate_rows()
        for name, r in found:
            print(f"{name:24} {r.kernel:12} {r.operands:15} sm_{r.arch} {r.registers:4} regs "
                  f"{r.spill_bytes:5} B spilled {r.shared_bytes / 1024:4.0f} KiB "
                  f"{r.num_warps} x {r.num_stages}")
        bad = [f"{name} {r.kernel} [{r.operands}, sm_{r.arch}]: {p}" for name, r in found
               for p in r.problems()]
        for line in bad:
            print(f"error: {line}", file=sys.stderr)
        return 1 if bad else 0
    rows = all_rows()
    print(table(rows))
    if not args.no_doc:
        write_doc(args.doc, rows)
    problems = [f"{r.kernel} [{r.operands}, sm_{r.arch}]: {p}" for r in rows for p in r.problems()]
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
