"""``PartialFC.begin_step(labels, embeddings=...)``: a step's statistics taken over all its
micro-batches, so a step split into micro-batches over 1, 2 or 4 ranks equals one forward of
its union: the loss, the embedding gradients, the dynamic AdaCos scale (whose ``s_t`` depends
on ``s_{t-1}``'s statistics), CurricularFace's ``t`` and AdaFace's norm EMAs, step after step,
and the statistics the step reports (``theta_med``, AdaCos's ``B_avg``)."""

from __future__ import annotations

import pytest
import torch
from spawn import run_ranks

from partial_fc import PartialFC, build_margin
from partial_fc import metric_names as names

CLASSES, DIM, MICRO, STREAMS, STEPS = 53, 8, 6, 4, 3
MARGINS = {
    "adacos": {"type": "adacos", "adacos": "dynamic"},
    "curricularface": {"type": "curricularface", "s": 16.0, "m": 0.5, "ema": 0.3},
    "adaface": {"type": "adaface", "s": 16.0, "m": 0.4, "ema": 0.3},
}
STATE = ("margin.scale.s", "margin.t", "margin.batch_mean", "margin.batch_std")


def _step_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's ``STREAMS`` micro-batches of ``MICRO`` samples, micro-batch ``j`` at rows
    ``[j * MICRO, (j + 1) * MICRO)`` (norms spread, for AdaFace)."""
    gen = torch.Generator().manual_seed(300 + step)
    n = STREAMS * MICRO
    emb = torch.randn(n, DIM, generator=gen) * (1 + 4 * torch.rand(n, 1, generator=gen))
    return emb, torch.randint(0, CLASSES, (n,), generator=gen)


def _steps(margin: dict, rank: int = 0, world: int = 1, statistics: bool = True,
           whole: bool = False, rate: float = 1.0) -> list[dict]:
    """``STEPS`` steps; rank ``rank`` of ``world`` runs micro-batches ``p * world + rank``
    (pass ``p``) after ``begin_step`` (with the embeddings when ``statistics``), or, with
    ``whole``, one forward of the step's union. Each step's loss, embedding gradients by
    global row, and the head's replicated state after it."""
    head = PartialFC(DIM, CLASSES, build_margin(margin), sample_rate=rate, seed=7)
    k = STREAMS // world
    out = []
    for step in range(STEPS):
        emb, labels = _step_batch(step)
        e = emb.clone().requires_grad_()
        if whole:
            loss = head(e, labels)
            loss.backward()
            loss = loss.item()
        else:
            rows = [slice(j * MICRO, (j + 1) * MICRO) for j in range(rank, STREAMS, world)]
            mine = torch.cat([torch.arange(STREAMS * MICRO)[r] for r in rows])
            head.begin_step(labels[mine], sizes=[k * MICRO] * world,
                            embeddings=emb[mine] if statistics else None)
            loss = 0.0
            for part in rows:
                micro = head(e[part], labels[part], sizes=[MICRO] * world)
                (micro / k).backward()
                loss += micro.item() / k
        head.pop_sampled_rows()
        state = head.state_dict()
        shown = [names.THETA_MED, names.COS_TARGET_MEAN] + \
            ([names.B_AVG] if margin["type"] == "adacos" else [])  # else the last pass's B
        out.append({"loss": loss, "e_grad": e.grad.clone(),
                    **{key: state[key].clone() for key in STATE if key in state},
                    "stats": {key: head.stats[key] for key in shown}})
        head.weight.grad = None
        with torch.no_grad():  # move the rows, so that later steps see other cosines
            move = torch.randn(CLASSES, DIM, generator=torch.Generator().manual_seed(step))
            head.weight.add_(0.3 * move[head.class_start:head.class_start + head.num_local])
    return out


def _check(got: list[dict], expected: list[dict], rows: torch.Tensor | None = None) -> None:
    for a, b in zip(got, expected, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        grad = b["e_grad"] if rows is None else b["e_grad"][rows]
        mine = a["e_grad"] if rows is None else a["e_grad"][rows]
        assert (mine - grad).abs().max() <= 1e-5 * grad.abs().max() + 1e-8
        for key in STATE:
            if key in b:
                torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
        assert a["stats"] == pytest.approx(b["stats"], rel=1e-5)  # what the step logs


def _ranks(rank: int, world: int) -> dict[str, list[dict]]:
    return {name: _steps(margin, rank, world) for name, margin in MARGINS.items()}


def _own_rows(rank: int, world: int) -> torch.Tensor:
    return torch.cat([torch.arange(j * MICRO, (j + 1) * MICRO)
                      for j in range(rank, STREAMS, world)])


@pytest.mark.parametrize("rate", [1.0, 0.3])
@pytest.mark.parametrize("name", sorted(MARGINS))
def test_one_rank_accumulating_the_step_equals_one_forward_of_it(name, rate):
    """At r = 0.3 too: the statistics are over the step's one class sample."""
    _check(_steps(MARGINS[name], rate=rate), _steps(MARGINS[name], whole=True, rate=rate))


def test_without_the_step_statistics_the_micro_batches_move_them_on_their_own():
    """The test can fail: per-micro-batch statistics give another scale and other EMAs."""
    for name in MARGINS:
        whole = _steps(MARGINS[name], whole=True)
        apart = _steps(MARGINS[name], statistics=False)
        key = next(key for key in STATE if key in whole[-1])
        assert not torch.allclose(apart[-1][key], whole[-1][key], rtol=1e-4), name


@pytest.mark.parametrize("world", [2, 4])
def test_the_step_split_over_ranks_equals_one_forward_of_it(world):
    whole = {name: _steps(margin, whole=True) for name, margin in MARGINS.items()}
    for rank, results in enumerate(run_ranks(_ranks, world)):
        for name, got in results.items():
            _check(got, whole[name], _own_rows(rank, world))
