"""The options that reproduce insightface arcface_torch's training (defaults unchanged; a
converted arcface_torch config sets them): a dense head update, DDP without buffer broadcast,
fp16 gradient compression, LR decay power 1, the same initial head rows on every rank, the
reported loss capped at -ln 1e-30. Each against the behaviour written out here."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from spawn import run_ranks
from tolerances import rounding_excess

from partial_fc import PartialFC, build_margin
from partial_fc.init import init_rows_
from partial_fc.optim import SampledSGD

C, D = 40, 8


def _sampled_step(head, opt, seed):
    g = torch.Generator().manual_seed(seed)
    e, y = torch.randn(6, D, generator=g), torch.randint(0, C, (6,), generator=g)
    head(e, y).backward()
    rows = head.pop_sampled_rows()
    grad = head.weight.grad.to_dense()
    opt.step(rows)
    head.weight.grad = None
    return rows.index, grad


def test_dense_head_update_is_one_sgd_over_the_whole_shard():
    head = PartialFC(D, C, build_margin(dict(type="cosface", s=16.0)), sample_rate=0.3)
    weight = torch.nn.Parameter(head.weight.detach().clone())
    reference = torch.optim.SGD([weight], lr=0.5, momentum=0.9, weight_decay=5e-3)
    opt = SampledSGD(head.weight, lr=0.5, momentum=0.9, weight_decay=5e-3, dense=True)
    lazy_head = PartialFC(D, C, build_margin(dict(type="cosface", s=16.0)), sample_rate=0.3)
    lazy = SampledSGD(lazy_head.weight, lr=0.5, momentum=0.9, weight_decay=5e-3)
    for step in range(3):
        before = lazy_head.weight.detach().clone()
        index, grad = _sampled_step(head, opt, step)
        weight.grad = grad
        reference.step()
        torch.testing.assert_close(head.weight.detach(), weight.detach(), rtol=1e-6, atol=1e-7)
        lazy_index, _ = _sampled_step(lazy_head, lazy, step)
        unsampled = torch.ones(C, dtype=torch.bool)
        unsampled[lazy_index] = False
        assert unsampled.any() and torch.equal(lazy_head.weight[unsampled], before[unsampled])
    assert not torch.equal(head.weight[unsampled], before[unsampled])  # moved by momentum


def test_per_rank_init_gives_every_rank_the_same_rows():
    rank0 = init_rows_(torch.empty(C, D), 0, seed=7)  # one rank's rows from class 0 on
    head = PartialFC(D, C, build_margin(dict(type="arcface")), seed=7, init="per_rank")
    assert torch.equal(head.weight.detach(), rank0)
    assert torch.equal(init_rows_(torch.empty(C - 1, D), 0, seed=7), rank0[:-1])  # 1 row less
    # On 2 ranks (test_ddp_...): rank 1 holds rank 0's rows, not classes 21.. of per_class.


def test_loss_cap_changes_the_reported_loss_not_the_gradient():
    """arcface_torch: ``loss.clamp_min_(1e-30).log_()`` of p_target; backward ``p - onehot``."""
    cap = -math.log(1e-30)
    losses, grads = [], []
    for loss_cap in (None, cap):
        head = PartialFC(D, 4, build_margin(dict(type="cosface", s=64.0, m=0.5)),
                         loss_cap=loss_cap)
        e = (-head.weight.detach()[:1]).requires_grad_()  # the target at cos = -1
        loss = head(e, torch.tensor([0]))
        loss.backward()
        losses.append(loss.item())
        grads.append(e.grad.clone())
    assert losses[0] > cap + 10 and losses[1] == pytest.approx(cap, rel=1e-6)
    assert torch.equal(grads[0], grads[1])


def test_lr_decay_power_one_is_polynomial_lr_warmup():
    """``PolynomialLRWarmup(power=1)``'s closed form after warm-up: ``(1 - (l - w)/(t - w))``,
    ``l`` the steps taken so far; partial-fc's step ``l`` is its ``l``-th update."""
    from trainer.config import ScheduleConfig
    from trainer.engine.optimizers import lr_factor

    factor = lr_factor(ScheduleConfig(type="poly", power=1.0), 0, 100)
    for step in (0, 1, 37, 99):
        assert factor(step) == pytest.approx(1.0 - step / 100)


def _ddp_work(rank, world):
    """Both settings (broadcast + no compression; neither + fp16), and the heads' rows."""
    out = {setting: _ddp_setting(rank, *setting) for setting in ((True, "none"),
                                                                   (False, "fp16"))}
    heads = {init: PartialFC(D, C + 1, build_margin(dict(type="arcface")), seed=7, init=init)
             for init in ("per_rank", "per_class")}
    return {**out, **{init: head.weight.detach().clone() for init, head in heads.items()}}


def _ddp_setting(rank, broadcast, compression):
    from trainer.config import Config
    from trainer.dist import attach
    from trainer.engine.ddp import DDPBackend

    model = _model()
    cfg = Config.model_validate({"engine": {"broadcast_buffers": broadcast,
                                            "grad_compression": compression}})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = DDPBackend(cfg, model, model, opt, attach(torch.device("cpu")))
    x = _batch(rank)
    backend.model(x)  # each rank's statistics move with its own batch
    model.eval()
    backend.model(x)  # no update in eval: only DDP's broadcast (if on) changes them
    mean = model[1].running_mean.clone()
    model.train()
    out = backend.model(x)
    loss = (out * torch.linspace(0.3, 1.1, 3)).sum()
    loss.backward()
    local = [p.grad.clone() for p in model.parameters()]
    # Each rank's own gradient, recomputed without DDP: what the hook sums.
    model.zero_grad()
    copy = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    copy.load_state_dict(model.state_dict())
    ((copy(x) * torch.linspace(0.3, 1.1, 3)).sum()).backward()
    mine = [p.grad.clone() for p in copy.parameters()]
    deprecated = [str(w.message) for w in caught
                  if issubclass(w.category, FutureWarning | DeprecationWarning)]
    return {"mean": mean, "reduced": local, "mine": mine, "deprecated": deprecated}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))


def _batch(rank):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(5, 3, generator=g) * (rank + 1) + 1.7 * rank


def _own_mean(rank):
    """The BatchNorm running mean after one training forward of ``rank``'s batch, one
    process, no DDP."""
    with torch.random.fork_rng():
        model = _model()
    model(_batch(rank))
    return model[1].running_mean


def test_buffer_sync_names_broadcast_buffers_where_ddp_lacks_forward_sync_buffers(monkeypatch):
    from trainer.engine import ddp

    class Older:  # DistributedDataParallel's signature before forward_sync_buffers
        def __init__(self, module, device_ids=None, broadcast_buffers=True,
                     process_group=None):
            pass

    monkeypatch.setattr(ddp, "DistributedDataParallel", Older)
    assert ddp.buffer_sync(False) == {"broadcast_buffers": False}
    assert ddp.buffer_sync(True) == {"broadcast_buffers": True}


@pytest.mark.slow
def test_ddp_buffer_broadcast_fp16_gradient_compression_and_per_rank_init():
    rank0, rank1 = run_ranks(_ddp_work, world_size=2)
    kept = [r[(True, "none")] for r in (rank0, rank1)]
    compressed = [r[(False, "fp16")] for r in (rank0, rank1)]
    assert torch.equal(rank1["per_rank"], rank0["per_rank"][:20])  # 21 + 20 rows
    assert torch.equal(rank1["per_class"], init_rows_(torch.empty(20, D), 21, seed=7))
    for rank in range(2):
        torch.testing.assert_close(kept[rank]["mean"], _own_mean(0))  # rank 0's, broadcast
        torch.testing.assert_close(compressed[rank]["mean"], _own_mean(rank))  # each its own
        for setting in (kept, compressed):  # the switch goes by torch's current name
            assert not [m for m in setting[rank]["deprecated"] if "broadcast_buffers" in m]
    assert not torch.equal(_own_mean(0), _own_mean(1))
    for i in range(len(compressed[0]["reduced"])):
        a, b = (compressed[r]["mine"][i] for r in range(2))
        want = (a.half() / 2 + b.half() / 2).float()  # fp16_compress_hook: cast, divide, sum
        # the sum of the fp16 halves rounded once to fp16, by gloo as here: one fp16 ulp
        assert rounding_excess(compressed[0]["reduced"][i], want, normwise=0,
                               dtype=torch.float16) <= 1
        assert torch.equal(compressed[0]["reduced"][i], compressed[1]["reduced"][i])
    exact = [(compressed[0]["mine"][i] + compressed[1]["mine"][i]) / 2
             for i in range(len(compressed[0]["mine"]))]
    assert any(not torch.equal(r, x) for r, x in zip(compressed[0]["reduced"], exact,
                                                     strict=True))  # fp16 did round
