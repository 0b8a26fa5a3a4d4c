"""Every Triton kernel the head launches compiles for sm_80 and sm_90 on this CPU machine
(``tools/kernels_aot.py``: triton's own ptxas, no GPU): no compile error anywhere, shared
memory within each device's per-block limit, and no spills in the default configurations
(a bf16 run's operands, with fp32 or bf16 head state). The interpreter tests run the same
kernels' arithmetic; only this compiles them.

The compiles run in a subprocess: ``triton.jit`` decides at import whether a kernel is
interpreted (``TRITON_INTERPRET=1``, which the interpreter tests set in this process) or
compiled, so one process cannot hold both kinds of the same kernels."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from launch_helpers import ROOT

from tools import kernels_aot  # imports no triton: that happens in the subprocess

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")

ARCHS = sorted(kernels_aot.DEVICES)
TIGHTEST = min(ARCHS, key=lambda arch: kernels_aot.DEVICES[arch]["smem_per_block"])
# The non-target transforms whose code contains every other's (clamp + inter-class filter,
# modulation + inter-class filter): compiled here for an aligned N; make kernels-aot compiles
# each transform both ways.
SUPERSETS = (", clamped, inter-class filter", ", curricular, inter-class filter")
COMPILE = """
import dataclasses, json, sys
from tools.kernels_aot import compile_row, launches
operands, arch, supersets = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = [compile_row(k, operands, aligned, arch) for k in launches(operands) if ", " not in k
        for aligned in (True, False)]
rows += [compile_row(k, operands, True, arch) for k in launches(operands)
         if k.endswith(tuple(supersets))]
print(json.dumps([dataclasses.asdict(r) for r in rows]))
"""


def _compiled(operands: str, arch: int, transforms: bool = True) -> list[kernels_aot.Row]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", COMPILE, operands, str(arch),
                          *(SUPERSETS if transforms else ())], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TRITON_DEFAULT_FP_FUSION" not in out.stderr, "a compile left FP fusion to Triton"
    return [kernels_aot.Row(**row) for row in json.loads(out.stdout.strip().splitlines()[-1])]


# make test compiles a bf16 run's kernels over fp32 class weights for sm_90 (the H100/H200
# the recipes name); over bf16 weights, and for the other archs, they compile through the
# same code for another configuration or target, in make test-long (~20 CPU-s each; every
# one in make kernels-aot).
@pytest.mark.parametrize("operands, arch", [
    (operands, arch) if (operands, arch) == ("bf16 e, fp32 w", 90) else
    pytest.param(operands, arch, marks=[pytest.mark.slow, pytest.mark.long])
    for arch in ARCHS for operands in kernels_aot.DEFAULT_OPERANDS])
def test_default_configurations_compile_without_spills(operands, arch):
    rows = _compiled(operands, arch)
    assert len(rows) == 12 and all(row.default and row.arch == arch for row in rows)
    assert {row.kernel for row in rows if not row.aligned} == {"stats", "dcos", "gemm grad_e",
                                                               "gemm grad_w"}
    assert [p for row in rows for p in row.problems()] == []
    assert all(0 < row.registers <= 255 and row.shared_bytes > 0 for row in rows)


# fp32 IEEE differs from fp32 TF32 only in the dots' input_precision constexpr: the same tiles
# and stages (kernels_aot.launches: triton.cuda_tiles for every operand combination) and the
# same shared memory (docs/kernels.md's table). Its FMA dots' compile alone is 30 CPU-s, left
# to `make kernels-aot` with the rest of every configuration on every device.
OTHER_OPERANDS = sorted(set(kernels_aot.OPERANDS) - set(kernels_aot.DEFAULT_OPERANDS)
                        - {"fp32 e, fp32 w, ieee"})


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("operands", OTHER_OPERANDS)
def test_every_other_configuration_compiles_within_shared_memory(operands):
    """fp32 and fp16 operands, on the device with the least shared memory per block: they
    must compile and fit; their spills are reported by ``make kernels-aot`` (docs/kernels.md),
    not refused (fp32 dots are the slow path). Their sm_90 compiles (another minute of the
    suite) are left to ``make kernels-aot``, which compiles every configuration for every
    device. So are their launches with a non-target transform: constexpr branches on values
    in registers, they change no tile and no shared memory (the default configurations
    compile them here, with their registers)."""
    assert [p for row in _compiled(operands, TIGHTEST, transforms=False)
            for p in row.problems()] == []


def test_problems_name_what_the_suite_refuses():
    """The refusal rules themselves, on made-up rows (a spill matters only by default)."""
    row = kernels_aot.Row("stats", kernels_aot.DEFAULT_OPERANDS[0], True, 90, registers=128,
                          spill_bytes=8, shared_bytes=228 * 1024, num_warps=8, num_stages=3)
    assert len(row.problems()) == 2
    other = kernels_aot.Row("stats", "fp32 e, fp32 w, ieee", True, 80, registers=255,
                            spill_bytes=640, shared_bytes=96 * 1024, num_warps=8, num_stages=3)
    assert other.problems() == []
    assert other.occupancy() == pytest.approx(8 / 64)  # 255 regs x 256 threads: one block
