"""Every Triton kernel the head launches compiles for sm_80 and sm_90 on this CPU machine
(``tools/kernels_aot.py``: triton's own ptxas, no GPU): no compile error anywhere, shared
memory within each device's per-block limit, and no spills in the default configurations
(a bf16 run's operands, with fp32 or bf16 head state). The interpreter tests run the same
kernels' arithmetic; only this compiles them."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
kernels_aot = pytest.importorskip("tools.kernels_aot")

ARCHS = sorted(kernels_aot.DEVICES)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("operands", kernels_aot.DEFAULT_OPERANDS)
def test_default_configurations_compile_without_spills(operands, arch):
    rows = [kernels_aot.compile_row(kernel, operands, aligned, arch)
            for kernel in kernels_aot.launches(operands) for aligned in (True, False)]
    assert all(row.default for row in rows)
    assert [p for row in rows for p in row.problems()] == []
    assert all(0 < row.registers <= 255 and row.shared_bytes > 0 for row in rows)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("operands", sorted(set(kernels_aot.OPERANDS)
                                            - set(kernels_aot.DEFAULT_OPERANDS)))
def test_every_other_configuration_compiles_within_shared_memory(operands, arch):
    """fp32 and fp16 operands: they must compile and fit; their spills are reported by
    ``make kernels-aot`` (docs/kernels.md), not refused (fp32 dots are the slow path)."""
    rows = [kernels_aot.compile_row(kernel, operands, aligned, arch)
            for kernel in kernels_aot.launches(operands) for aligned in (True, False)]
    assert [p for row in rows for p in row.problems()] == []


def test_problems_name_what_the_suite_refuses():
    """The refusal rules themselves, on made-up rows (a spill matters only by default)."""
    row = kernels_aot.Row("stats", kernels_aot.DEFAULT_OPERANDS[0], True, 90, registers=128,
                          spill_bytes=8, shared_bytes=228 * 1024, num_warps=8, num_stages=3)
    assert len(row.problems()) == 2
    other = kernels_aot.Row("stats", "fp32 e, fp32 w, ieee", True, 80, registers=255,
                            spill_bytes=640, shared_bytes=96 * 1024, num_warps=8, num_stages=3)
    assert other.problems() == []
    assert other.occupancy() == pytest.approx(8 / 64)  # 255 regs x 256 threads: one block
