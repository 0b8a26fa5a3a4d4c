"""AdaFace, CurricularFace, MagFace, ElasticFace(+), the inter-class filter and ArcFace's
auxiliary losses on 1, 2 and 3 ranks against the single-process float64 reference of
``margin_reference`` (the papers' equations).

One process group per world size runs every case (``_run``): the loss, every embedding and
head-row gradient at ``sample_rate`` 1 and 0.5 (the reference runs over the same sample), two
accumulated micro-batches, and the EMA statistics over 5 training forwards; then the same
margins with their batch statistic computed on the rank's own rows (what a per-GPU
implementation does), which must *not* match the reference: the check that the comparison
can fail where the statistic is not global.
"""

import dataclasses

import margin_reference as ref
import pytest
import torch
from spawn import run_ranks

from partial_fc import PartialFC, build_margin
from partial_fc.aux_losses import AuxLosses

C, D = 61, 16  # uneven over 2 and 3 ranks
LABELS = [0, 20, 21, 40, 41, 60, 20, 5, 0, 33, 21, 59]  # shard edges; repeats: triplets
LABELS2 = [3, 60, 30, 31, 0, 7, 30, 44, 45, 3, 12, 13]  # the second micro-batch
N = len(LABELS)
S = 16.0
CASES = {
    "adaface": (dict(type="adaface", s=S, m=0.4, h=0.333, ema=0.01), {}),
    "curricularface": (dict(type="curricularface", s=S, m=0.5, ema=0.01), {}),
    "magface": (dict(type="magface", s=S, l_a=10.0, u_a=110.0, l_m=0.45, u_m=0.8,
                     lambda_g=35.0), {}),
    "magface_fallback": (dict(type="magface", s=S, l_a=10.0, u_a=110.0, l_m=0.45, u_m=0.8,
                              lambda_g=35.0, easy_margin=False), {}),
    "elasticface_cos": (dict(type="elasticface_cos", s=S, m=0.35, sigma=0.05), {}),
    "elasticface_arc_plus": (dict(type="elasticface_arc_plus", s=S, m=0.5, sigma=0.05), {}),
    "elasticface_cos_plus_paper": (dict(type="elasticface_cos_plus", s=S, m=0.35, sigma=0.05,
                                        elastic_sort="paper"), {}),
    "arcface_filter": (dict(type="arcface", s=S, m=0.5, interclass_filter=0.2), {}),
    "arcface_aux": (dict(type="arcface", s=S, m=0.5),
                    dict(intra=0.7, inter=0.9, triplet=0.8, triplet_margin=0.35)),
}
EMA_CASES = ("adaface", "curricularface")
# a statistic a per-GPU code gets wrong
LOCAL_CASES = ("adaface", "curricularface", "magface", "elasticface_arc_plus",
               "elasticface_cos_plus_paper")
EMA_STEPS = 5
TILE = 4 * 2 * N * 7  # 7-column class chunks even for two micro-batches


def _data(seed=0, labels=LABELS):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(N, D, generator=g)
    emb *= torch.linspace(1.5, 14.0, N)[:, None]  # norms ~6..56: MagFace's clamp at 10 bites
    weight = torch.randn(C, D, generator=g)
    for i, pull in ((0, 0.3), (3, 0.3), (7, 1.5), (9, 2.0), (11, 1.5)):  # some well classified
        weight[labels[i]] += pull * emb[i] / emb[i].norm() * weight[labels[i]].norm()
    return emb, weight, torch.tensor(labels)


def _head(name, weight, sample_rate=1.0):
    cfg, aux = CASES[name]
    head = PartialFC(D, C, build_margin(cfg), sample_rate=sample_rate, kernel="torch",
                     max_tile_bytes=TILE, aux_losses=AuxLosses(**aux))
    with torch.no_grad():
        head.weight.copy_(weight[head.class_start: head.class_start + head.num_local])
    return head


def _ema(head):
    margin = head.margin
    if hasattr(margin, "batch_mean"):
        return {"mu": margin.batch_mean.item(), "sd": margin.batch_std.item()}
    return {"t": margin.t.item()} if hasattr(margin, "t") else {}


def _forward(head, emb, labels):
    emb = emb.clone().requires_grad_()
    loss = head(emb, labels)
    loss.backward()
    return dict(loss=loss.item(), stats=dict(head.stats), egrad=emb.grad.clone())


def _local_statistic(head, world):
    """Compute the margin's statistic from one rank's rows at a time, as a per-GPU
    implementation does: its own (AdaFace, CurricularFace, MagFace: the EMA input, the
    regulariser's mean), each rank's block (ElasticFace+: ranked within the block)."""
    margin, inner = head.margin, type(head.margin).statistic

    def cut(batch, rows):
        norms = batch.norms[rows] if batch.norms is not None else None
        return dataclasses.replace(batch, target_cos=batch.target_cos[rows], norms=norms,
                                   rows=slice(0, rows.stop - rows.start))

    def local(batch):
        if getattr(margin, "sort", None) is None:
            return inner(margin, cut(batch, batch.rows))
        n = len(batch.target_cos) // world
        return torch.cat([inner(margin, cut(batch, slice(r * n, (r + 1) * n))) + r * n
                          for r in range(world)])

    margin.statistic = local


def _run(rank, world):
    emb, weight, labels = _data()
    emb2, _, labels2 = _data(1, LABELS2)
    n = N // world
    mine = slice(rank * n, (rank + 1) * n)
    out = {}
    for name in CASES:
        for rate in (1.0, 0.5):
            head = _head(name, weight, rate)
            res = _forward(head, emb[mine], labels[mine])
            res.update(wgrad=head.weight.grad.to_dense(), ema=_ema(head),
                       index=head.sampled_index, start=head.class_start,
                       state_keys=sorted(head.state_dict()))
            out[name, rate] = res
        head = _head(name, weight, 0.5)  # two accumulated micro-batches, one class sample
        e1, e2 = emb[mine].clone().requires_grad_(), emb2[mine].clone().requires_grad_()
        head.begin_step(torch.cat([labels[mine], labels2[mine]]))
        losses = []
        for e, y in ((e1, labels[mine]), (e2, labels2[mine])):
            loss = head(e, y)
            loss.backward()
            losses.append(loss.item())
        out[name, "accum"] = dict(losses=losses, egrad=torch.cat([e1.grad, e2.grad]),
                                  wgrad=head.weight.grad.to_dense(), ema=_ema(head),
                                  index=head.pop_sampled_rows().index, start=head.class_start)
    for name in EMA_CASES:
        head = _head(name, weight)
        emas = []
        for k in range(EMA_STEPS):
            head(emb[mine] * (1 + 0.3 * k), labels[mine]).backward()
            emas.append(_ema(head))
        out[name, "steps"] = emas
    for name in LOCAL_CASES:
        head = _head(name, weight)
        _local_statistic(head, world)
        res = _forward(head, emb[mine], labels[mine])
        res.update(wgrad=head.weight.grad.to_dense(), ema=_ema(head))
        out[name, "local"] = res
    return out


def _sample(results, key):
    """The classes the ranks sampled (global, sorted) or None for all."""
    if results[0][key]["index"] is None:
        return None
    return torch.cat([r[key]["start"] + r[key]["index"] for r in results])


def _reference(name, emb, weight, labels, cls, state=None, draw=0):
    cfg, aux = CASES[name]
    cols = labels if cls is None else torch.searchsorted(cls, labels)
    w = (weight if cls is None else weight[cls]).double().requires_grad_()
    e = emb.double().requires_grad_()
    loss, state = ref.reference(cfg, aux, e, w, cols, state or dict(ref.INITIAL_STATE), 0, draw)
    loss.backward()
    wgrad = torch.zeros(C, D, dtype=torch.float64)
    wgrad[slice(None) if cls is None else cls] = w.grad
    return loss.item(), e.grad, wgrad, state


def _close(got, want, what):
    torch.testing.assert_close(got.double(), want, rtol=1e-5,
                               atol=1e-5 * max(want.abs().max().item(), 1e-12), msg=what)


def _check_forward(name, key, results, emb, weight, labels):
    got = [r[(name, key)] for r in results]
    for r in got[1:]:
        assert r["loss"] == got[0]["loss"] and r["stats"] == got[0]["stats"], (name, key)
        assert r["ema"] == got[0]["ema"], (name, key)
    cls = _sample(results, (name, key)) if key != "local" else None
    loss, egrad, wgrad, state = _reference(name, emb, weight, labels, cls)
    assert got[0]["loss"] == pytest.approx(loss, rel=1e-5), (name, key)
    assert got[0]["stats"]["loss"] == got[0]["loss"]
    _close(torch.cat([r["egrad"] for r in got]), egrad, (name, key, "egrad"))
    _close(torch.cat([r["wgrad"] for r in got]), wgrad, (name, key, "wgrad"))
    for k, v in got[0]["ema"].items():
        assert v == pytest.approx(state[k], rel=1e-5), (name, key, k)


def _check(world, results):
    emb, weight, labels = _data()
    emb2, _, labels2 = _data(1, LABELS2)
    for name in CASES:
        for rate in (1.0, 0.5):
            _check_forward(name, rate, results, emb, weight, labels)
        keys = results[0][name, 1.0]["state_keys"]
        if name in EMA_CASES:  # the EMA is state: the head's state_dict carries it
            assert {"margin.batch_mean", "margin.batch_std", "margin.t"} & set(keys), keys
        _check_accumulation(name, results, emb, emb2, weight, labels, labels2)
    for name in EMA_CASES:
        emas = [r[name, "steps"] for r in results]
        assert all(e == emas[0] for e in emas), name
        state = dict(ref.INITIAL_STATE)
        for k in range(EMA_STEPS):
            *_, state = _reference(name, emb * (1 + 0.3 * k), weight, labels, None, state)
            for key, v in emas[0][k].items():
                assert v == pytest.approx(state[key], rel=1e-5), (name, k, key)
    if world > 1:  # the same margins with per-rank statistics are no longer exact
        for name in LOCAL_CASES:
            with pytest.raises(AssertionError):
                _check_forward(name, "local", results, emb, weight, labels)


def _check_accumulation(name, results, emb, emb2, weight, labels, labels2):
    got = [r[name, "accum"] for r in results]
    cls = _sample(results, (name, "accum"))
    loss1, egrad1, wgrad1, state = _reference(name, emb, weight, labels, cls)
    loss2, egrad2, wgrad2, state = _reference(name, emb2, weight, labels2, cls, state, draw=1)
    assert got[0]["losses"] == pytest.approx([loss1, loss2], rel=1e-5), name
    n = N // len(results)
    egrad = torch.cat([torch.cat([g1[r * n:(r + 1) * n], g2[r * n:(r + 1) * n]])
                       for r, (g1, g2) in enumerate([(egrad1, egrad2)] * len(results))])
    _close(torch.cat([r["egrad"] for r in got]), egrad, (name, "accum egrad"))
    _close(torch.cat([r["wgrad"] for r in got]), wgrad1 + wgrad2, (name, "accum wgrad"))
    for k, v in got[0]["ema"].items():
        assert v == pytest.approx(state[k], rel=1e-5), (name, "accum", k)


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow),
                                   pytest.param(3, marks=pytest.mark.slow)])
def test_margins_equal_one_process_on_any_rank_count(world):
    """World size 1 runs in this process with no process group (the single-GPU user)."""
    if world == 1:
        assert not torch.distributed.is_initialized()
    _check(world, [_run(0, 1)] if world == 1 else run_ranks(_run, world))
