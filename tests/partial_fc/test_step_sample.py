"""``PartialFC.begin_step``: k accumulated micro-batches that share one class sample and one
head step equal their union in one batch (loss, embedding gradients, every weight row's
gradient), on one process and on 3 ranks with uneven shards."""

from __future__ import annotations

import pytest
import torch
from spawn import run_ranks

from partial_fc import PartialFC, build_margin

CLASSES, DIM, K, MICRO = 97, 8, 3, 10
MARGINS = {
    "arcface_warmup": {"type": "arcface", "s": 16.0, "m": 0.5, "warmup_steps": 4},
    "sphereface": {"type": "sphereface", "s": 16.0, "m": 4},
    "cosface": {"type": "cosface", "s": 16.0, "m": 0.35},
}


def _batches(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of ``K * MICRO * world`` samples for ``step``."""
    gen = torch.Generator().manual_seed(100 + step)
    n = K * MICRO * world
    return torch.randn(n, DIM, generator=gen), torch.randint(0, CLASSES, (n,), generator=gen)


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if grad.is_sparse else grad


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Normwise: a row's gradient sums K micro-batch terms in another order than one batch's
    does, so an entry's error is bounded by the tensor's largest entries, not by its own."""
    err, scale = (actual - expected).abs().max().item(), expected.abs().max().item()
    assert err <= 1e-5 * scale + 1e-7, f"max error {err:.3g}, largest entry {scale:.3g}"


def _steps(margin: dict, rate: float, accumulate: bool, rank: int = 0, world: int = 1,
           steps: int = 3) -> list[dict]:
    """Three steps of one head on this rank's share; each step's loss, embedding gradient and
    weight gradient. ``accumulate``: K micro-batches after ``begin_step``; else one batch."""
    head = PartialFC(DIM, CLASSES, build_margin(margin), sample_rate=rate, seed=7)
    out = []
    for step in range(steps):
        emb, labels = _batches(step, world)
        per = K * MICRO
        mine = slice(rank * per, (rank + 1) * per)
        e = emb[mine].clone().requires_grad_()
        if accumulate:
            head.begin_step(labels[mine], sizes=[per] * world)
            loss = 0.0
            for j in range(K):
                part = slice(j * MICRO, (j + 1) * MICRO)
                micro_loss = head(e[part], labels[mine][part], sizes=[MICRO] * world)
                (micro_loss / K).backward()
                loss += micro_loss.item() / K
        else:
            whole = head(e, labels[mine])
            whole.backward()
            loss = whole.item()
        rows = head.pop_sampled_rows()
        out.append({"loss": loss, "e_grad": e.grad.clone(), "w_grad": _dense(head.weight.grad),
                    "rows": None if rows.index is None else rows.index.clone(),
                    "step": int(head.step)})
        head.weight.grad = None
        with torch.no_grad():  # move the rows, so that later steps see other cosines
            head.weight.mul_(1.0 + 0.1 * step)
    return out


@pytest.mark.parametrize("margin", sorted(MARGINS))
@pytest.mark.parametrize("rate", [0.3, 1.0])
def test_accumulated_micro_batches_equal_one_batch(margin, rate):
    """Micro-batches are not mirror images of the whole: the union at r = 0.3 samples the
    negatives of the whole batch, which per-micro-batch sampling would not."""
    whole = _steps(MARGINS[margin], rate, accumulate=False)
    micro = _steps(MARGINS[margin], rate, accumulate=True)
    for a, b in zip(micro, whole, strict=True):
        assert a["step"] == b["step"]  # the head advanced once per step, not once per forward
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        _close(a["e_grad"], b["e_grad"])
        _close(a["w_grad"], b["w_grad"])
        if rate < 1:
            assert torch.equal(a["rows"], b["rows"]) and len(a["rows"]) < CLASSES


def _distributed(rank: int, world: int) -> list[list[dict]]:
    return [_steps(MARGINS["arcface_warmup"], 0.3, accumulate, rank, world, steps=2)
            for accumulate in (False, True)]


@pytest.mark.slow
def test_accumulation_on_three_ranks_equals_one_batch():
    for whole, micro in run_ranks(_distributed, 3):
        for a, b in zip(micro, whole, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
            _close(a["e_grad"], b["e_grad"])
            _close(a["w_grad"], b["w_grad"])
            assert torch.equal(a["rows"], b["rows"])


def test_more_samples_than_announced_and_an_unpopped_step_are_refused():
    head = PartialFC(DIM, CLASSES, build_margin(MARGINS["cosface"]), sample_rate=0.3)
    emb, labels = _batches(0, 1)
    head.begin_step(labels[:MICRO])
    head(emb[:MICRO], labels[:MICRO])
    with pytest.raises(RuntimeError, match="more than the 10 begin_step announced"):
        head(emb[:MICRO], labels[:MICRO])
    with pytest.raises(RuntimeError, match="pop_sampled_rows"):
        head.begin_step(labels[:MICRO])
    head.pop_sampled_rows()
    head.begin_step(labels[:MICRO])  # the next step starts cleanly after the pop
