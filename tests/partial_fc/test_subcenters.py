"""Sub-center ArcFace (``PartialFC(subcenters=K)``) on 1, 2 and 3 ranks against a float64
reference written here from the paper's definition (Deng et al., ECCV 2020, Sec. 3.1):

    cos theta_ij = max_k cos(x_i, W_jk),   L = CE(s cos theta with the target's replaced by
    s psi(cos theta_iy))

materialised as ``[N, C, K]`` cosines, autograd for every gradient. Compared: the loss, every
embedding gradient, every head row's gradient (``K`` per class, the argmax centre's nonzero,
the others' zero), the dominant-center share, at ``r = 1`` and ``r < 1`` (the reference takes
the sampled classes the ranks report, and checks that each sampled class came with all its
``K`` rows), and with gradient accumulation (two micro-batches sharing one ``begin_step``
sample: the gradients add up to those of the two micro-batch losses).
"""

from __future__ import annotations

import head_reference as ref
import pytest
import torch
import torch.nn.functional as F
from spawn import run_ranks

from partial_fc import PartialFC, build_margin
from partial_fc.metric_names import SUBCENTER_SHARE
from partial_fc.tiles import ReferenceTiles

C, K, D = 31, 3, 8  # 31 classes: uneven over 2 and 3 ranks
LABELS = [0, 10, 11, 20, 21, 30, 10, 5, 11, 29, 0, 15]
N = len(LABELS)
ARC = dict(type="arcface", s=16.0, m=0.5)
COS = dict(type="cosface", s=16.0, m=0.35)
RATE = 0.3
TILE = 4 * N * 2 * K  # two classes per chunk: several chunks per shard, a partial last


def _data():
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(N, D, generator=g)
    centres = torch.randn(C, K, D, generator=g)
    # a noisy sample: its label's class has a centre near it that is not the usual one
    centres[5, 2] = emb[7] + 0.1 * torch.randn(D, generator=g)
    centres[20, 0] = emb[3] + 0.1 * torch.randn(D, generator=g)
    return emb, centres, torch.tensor(LABELS)


def reference(emb, centres, labels, cfg, classes=None):
    """float64 loss over ``classes`` (sorted global classes; None = all) and the
    dominant-center share of this batch alone; autograd gives the gradients."""
    if classes is not None:
        centres = centres[classes]
        labels = torch.searchsorted(classes, labels)
    cos_k = torch.einsum("nd,ckd->nck", F.normalize(emb, dim=1), F.normalize(centres, dim=2))
    cos, nearest = cos_k.max(dim=2)
    onehot = F.one_hot(labels, cos.shape[1]).bool()
    logits = cfg["s"] * cos.masked_scatter(onehot, ref.psi(cfg, cos[onehot]))
    return F.cross_entropy(logits, labels), nearest[onehot]


def _share(labels, nearest):
    counts = torch.zeros(C, K)
    counts.index_put_((labels, nearest), torch.ones(len(labels)), accumulate=True)
    return (counts.amax(dim=1).sum() / counts.sum()).item()


def _head(cfg, centres, sample_rate=1.0):
    head = PartialFC(D, C, build_margin({**cfg, "subcenters": K}), sample_rate=sample_rate,
                     kernel="torch", max_tile_bytes=TILE, subcenters=K)
    with torch.no_grad():
        head.weight.copy_(centres[head.class_start: head.class_start + head.num_local]
                          .reshape(-1, D))
    return head


def _local(rank, world):
    per = N // world
    return slice(rank * per, (rank + 1) * per)


def _run(rank: int, world: int) -> dict:
    emb, centres, labels = _data()
    mine = _local(rank, world)
    out = {}
    for name, cfg, rate in (("arcface", ARC, 1.0), ("cosface", COS, 1.0),
                            ("arcface_sampled", ARC, RATE)):
        head = _head(cfg, centres, rate)
        e = emb[mine].clone().requires_grad_()
        loss = head(e, labels[mine])
        loss.backward()
        out[name] = dict(loss=loss.item(), share=head.stats[SUBCENTER_SHARE],
                         egrad=e.grad, wgrad=head.weight.grad.to_dense(),
                         rows=head.sampled_index, start=head.class_start)
    head = _head(ARC, centres, RATE)  # two micro-batches, one sample
    e = emb[mine].clone().requires_grad_()
    half = e.shape[0] // 2
    head.begin_step(labels[mine])
    losses = []
    for part in (slice(0, half), slice(half, None)):
        loss = head(e[part], labels[mine][part])
        loss.backward()
        losses.append(loss.item())
    rows = head.pop_sampled_rows()
    out["accumulated"] = dict(losses=losses, egrad=e.grad, wgrad=head.weight.grad.to_dense(),
                              rows=rows.index, start=head.class_start)
    return out


def _sampled_classes(results, name):
    """The global classes the ranks sampled, checking each came with its K rows."""
    classes = []
    for r in results:
        rows = r[name]["rows"]
        assert rows is not None
        per_class = rows.view(-1, K)
        assert torch.equal(per_class, per_class[:, :1] + torch.arange(K)), "K rows per class"
        classes.append(per_class[:, 0] // K + r[name]["start"])
    return torch.cat(classes)


def _full_wgrad(results, name, classes=None):
    """Every rank's rows, ``[C, K, D]``, restricted to ``classes``."""
    full = torch.cat([r[name]["wgrad"] for r in results]).double().view(C, K, D)
    return full if classes is None else full[classes]


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                               msg=what)


def _check(world, results):
    emb, centres, labels = _data()
    for name, cfg in (("arcface", ARC), ("cosface", COS), ("arcface_sampled", ARC)):
        classes = None
        if name.endswith("sampled"):
            classes = _sampled_classes(results, name)
            assert set(LABELS) <= set(classes.tolist())  # every positive kept
            assert len(classes) < C
        e, w = emb.double().requires_grad_(), centres.double().requires_grad_()
        loss, nearest = reference(e, w, labels, cfg, classes)
        loss.backward()
        for r in results:
            assert r[name]["loss"] == pytest.approx(loss.item(), rel=1e-5), name
        if classes is None:
            for r in results:
                assert r[name]["share"] == pytest.approx(_share(labels, nearest)), name
        _close(torch.cat([r[name]["egrad"] for r in results]).double(), e.grad, name)
        got_w = _full_wgrad(results, name)
        if classes is not None:  # nothing outside the sample, then compare the sampled rows
            outside = torch.ones(C, dtype=torch.bool)
            outside[classes] = False
            assert not got_w[outside].any(), name
            got_w, want_w = got_w[classes], w.grad[classes]
        else:
            want_w = w.grad
        _close(got_w, want_w, name)
    # accumulation: micro-batch j of the global batch is every rank's j-th half
    classes = _sampled_classes(results, "accumulated")
    per = N // world
    e, w = emb.double().requires_grad_(), centres.double().requires_grad_()
    total = 0
    for j, (a, b) in enumerate([(0, per // 2), (per // 2, per)]):
        idx = torch.cat([torch.arange(r * per + a, r * per + b) for r in range(world)])
        loss, _ = reference(e[idx], w, labels[idx], ARC, classes)
        assert results[0]["accumulated"]["losses"][j] == pytest.approx(loss.item(), rel=1e-5)
        total = total + loss
    total.backward()
    _close(torch.cat([r["accumulated"]["egrad"] for r in results]).double(), e.grad, "accum")
    _close(_full_wgrad(results, "accumulated", classes), w.grad[classes], "accum")


def test_the_data_uses_every_centre():
    """The batch's targets are nearest to different centres (the planted one for sample 7),
    so the comparisons below route gradients to every k, not only to k = 0."""
    emb, centres, labels = _data()
    _, nearest = reference(emb.double(), centres.double(), labels, ARC)
    assert nearest[7] == 2 and set(nearest.tolist()) == set(range(K))


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow),
                                   pytest.param(3, marks=pytest.mark.slow)])
def test_sharded_subcenters_equal_reference(world):
    """One rank runs in this process, with no process group (the single-GPU user)."""
    _check(world, [_run(0, 1)] if world == 1 else run_ranks(_run, world))


def test_k_rows_stay_together_in_a_checkpoint_row_block():
    """``row_start`` and the class-major layout: a class's K rows are one block of the global
    ``[K * C, D]`` matrix, on the class's own shard, whatever the world size."""
    head = _head(ARC, _data()[1])
    assert head.weight.shape == (K * C, D) and head.row_start == 0
    assert "subcenters=3" in repr(head)
    assert head.take_notes() == []  # kernel="torch": nothing to say
    auto = PartialFC(D, C, build_margin(ARC), subcenters=K)
    assert [n for n in auto.take_notes() if "K-way max" in n] and auto.take_notes() == []
    assert auto.tiles.for_device(torch.device("cuda", 0)) == ReferenceTiles(auto.max_tile_bytes, K)
    with pytest.raises(ValueError, match="subcenters=0"):
        PartialFC(D, C, build_margin(ARC), subcenters=0)
    with pytest.raises(ValueError, match="kernel='triton': the Triton kernels have no K-way max"):
        PartialFC(D, C, build_margin(ARC), subcenters=K, kernel="triton")


def test_angle_sample_measures_each_class_by_its_best_centre():
    emb, centres, labels = _data()
    angles = _head(ARC, centres).angle_sample(emb, labels, per_rank=100)
    cos, _ = torch.einsum("nd,ckd->nck", F.normalize(emb, dim=1),
                          F.normalize(centres, dim=2)).max(dim=2)
    theta = torch.rad2deg(torch.acos(cos.clamp(-1, 1)))
    torch.testing.assert_close(angles["theta_target"].sort().values,
                               theta[torch.arange(N), labels].sort().values, rtol=0, atol=1e-3)
    gap = (angles["theta_nontarget"][:, None] - theta.flatten()[None]).abs()
    assert gap.min(dim=1).values.max() < 1e-3
