"""The head's first-use check of its Triton kernels (partial_fc.tiles.selfcheck).

Without CUDA the kernels run in triton's interpreter (``TRITON_INTERPRET=1``, set before triton
is imported, as tests/partial_fc/test_tiles.py does). ``head.kernel=auto`` picks the kernels
on CUDA only, so its branch is reached here by faking that one decision (``select`` answering
the Triton module for a CPU tensor). A kernel is corrupted at the seam the head calls, the
back-end module's function, so the check sees exactly what a miscompiled kernel would return.
"""

from __future__ import annotations

import os

import pytest
import torch

from partial_fc import PartialFC, build_margin
from partial_fc.tiles import ReferenceTiles, selfcheck

if not torch.cuda.is_available():  # must precede the first import of triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
tm = pytest.importorskip("partial_fc.tiles.triton",
                         reason="triton is not installed (pip install triton)")
from partial_fc.tiles import autotune  # noqa: E402 - after the interpreter is chosen

C, D, N = 40, 16, 12
ARC = dict(type="arcface", s=16.0, m=0.5)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, D, generator=g), torch.randint(0, C, (N,), generator=g)


def _head(kernel, margin=ARC):
    torch.manual_seed(0)
    return PartialFC(D, C, build_margin(margin), kernel=kernel, max_tile_bytes=4 * N * 7)


def _step(head):
    emb, labels = _batch()
    e = emb.clone().requires_grad_()
    loss = head(e, labels)
    loss.backward()
    return loss.item(), e.grad, head.weight.grad


@pytest.fixture
def auto_picks_triton(monkeypatch):
    """``head.kernel=auto`` as on a CUDA device: the Triton back-end."""
    real = selfcheck.select
    monkeypatch.setattr(selfcheck, "select", lambda kernel, device, budget:
                        tm if kernel == "auto" else real(kernel, device, budget))


def _corrupt_grad_w(monkeypatch, factor=1.5):
    real = tm.class_tile_grads

    def wrong(*args, **kw):
        grad_e, grad_w = real(*args, **kw)
        return grad_e, grad_w * factor

    monkeypatch.setattr(tm, "class_tile_grads", wrong)


@pytest.mark.parametrize("margin", [ARC, dict(type="sphereface", m=4, s=8.0),
                                    dict(type="cosface", m=0.35, adacos="dynamic")])
def test_honest_kernels_pass_and_keep_running(margin):
    head = _head("triton", margin)
    got = _step(head)
    assert head.take_notes() == []
    assert head.tiles.for_device(torch.device("cpu")) is autotune.TUNED  # still the kernels
    want = _step(_head("torch", margin))
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_corrupted_kernel_falls_back_to_torch_with_one_line(monkeypatch, auto_picks_triton):
    _corrupt_grad_w(monkeypatch)
    checks = []
    real_compare = selfcheck.compare
    monkeypatch.setattr(selfcheck, "compare", lambda *a: checks.append(1) or real_compare(*a))
    head = _head("auto")
    got = _step(head)
    notes = head.take_notes()
    assert len(notes) == 1 and "\n" not in notes[0], notes
    assert "class_tile_grads" in notes[0] and "grad_w differs by 0.5" in notes[0]
    assert "head.kernel=torch" in notes[0] and "rank 0" in notes[0]
    assert isinstance(head.tiles.for_device(torch.device("cpu")), ReferenceTiles)
    want = _step(_head("torch"))  # the step itself already ran on the torch path: identical
    assert got[0] == want[0]
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    _step(head)  # checked once per device
    assert checks == [1] and head.take_notes() == []


def test_a_transform_variant_is_checked_at_its_first_use(monkeypatch, auto_picks_triton):
    """CurricularFace hands the kernels its hard-negative modulation, other compiled variants
    than the plain launches the first check ran: with those variants alone wrong (here the
    hard-negative counts), the step that first hands them the transform checks them, goes on
    with the torch path and says so once; the plain and the transform checks run once each."""
    real = tm.class_tile_stats

    def miscounts(*args, nontarget=None, **kw):
        out = real(*args, nontarget=nontarget, **kw)
        if nontarget is not None and nontarget.hard_rows is not None:
            nontarget.hard_rows.add_(1.0)
        return out

    monkeypatch.setattr(tm, "class_tile_stats", miscounts)
    checks = []
    real_compare = selfcheck.compare
    monkeypatch.setattr(selfcheck, "compare",
                        lambda *a: checks.append(a[-1] is not None) or real_compare(*a))
    curricular = dict(type="curricularface", s=16.0)
    head = _head("auto", curricular)
    got = _step(head)
    (note,) = head.take_notes()
    assert "class_tile_stats disagrees with the torch reference: hard_rows" in note, note
    assert isinstance(head.tiles.for_device(torch.device("cpu")), ReferenceTiles)
    want = _step(_head("torch", curricular))
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    _step(head)
    assert checks == [False, True] and head.take_notes() == []


def test_a_launch_failure_falls_back_naming_the_kernel(monkeypatch, auto_picks_triton):
    def fails(*args):
        raise RuntimeError("PTX .version 8.7 does not support .target sm_120\nmore")

    monkeypatch.setattr(tm, "class_tile_stats", fails)
    head = _head("auto")
    _step(head)
    (note,) = head.take_notes()
    assert "class_tile_stats failed to compile or launch: RuntimeError: PTX .version 8.7" in note
    assert "more" not in note and "head.kernel=torch" in note


def test_head_kernel_triton_makes_the_failure_fatal(monkeypatch):
    _corrupt_grad_w(monkeypatch, factor=-1.0)
    with pytest.raises(selfcheck.KernelCheckFailed, match=r"class_tile_grads.*head\.kernel="
                                                           r"triton makes this fatal"):
        _step(_head("triton"))


def test_the_tolerance_follows_the_operands():
    f32 = torch.zeros(2, 2)
    assert selfcheck.tolerance(f32, f32) == 1e-3
    assert selfcheck.tolerance(f32, f32.bfloat16()) == 3e-2
    torch.set_float32_matmul_precision("high")
    try:
        assert selfcheck.tolerance(f32, f32) == 3e-2  # TF32 dots round their operands
    finally:
        torch.set_float32_matmul_precision("highest")


def test_a_small_error_within_tolerance_passes(monkeypatch):
    """The check is a tolerance, not equality: a kernel off by 1e-5 relative still runs."""
    _corrupt_grad_w(monkeypatch, factor=1 + 1e-5)
    head = _head("triton")
    _step(head)
    assert head.take_notes() == []


def _one_rank_corrupted(rank: int, world: int, kernel: str) -> dict:
    from partial_fc.tiles import triton as kernels

    if rank == 1:
        real = kernels.class_tile_grads

        def doubled_grad_e(*args, **kw):  # one kernel call, its grad_e wrong
            grad_e, grad_w = real(*args, **kw)
            return grad_e * 2.0, grad_w

        kernels.class_tile_grads = doubled_grad_e
    emb, labels = _batch()
    head = PartialFC(D, C, build_margin(ARC), kernel=kernel)
    mine = slice(rank * N // world, (rank + 1) * N // world)
    try:
        head(emb[mine], labels[mine]).backward()
    except selfcheck.KernelCheckFailed as err:
        return {"error": str(err)}
    return {"notes": head.take_notes(),
            "torch_path": isinstance(head.tiles.for_device(torch.device("cpu")), ReferenceTiles)}


@pytest.mark.slow
def test_every_rank_learns_of_one_ranks_failure():
    """Rank 1's kernels are wrong, rank 0's are not: with head.kernel=triton both raise the
    same line (no rank left waiting in a collective)."""
    from spawn import run_ranks

    results = run_ranks(_one_rank_corrupted, 2, args=("triton",))
    assert results[0]["error"] == results[1]["error"]
    assert "on rank 1: class_tile_grads" in results[0]["error"]
    assert "grad_e differs by 1" in results[0]["error"]
