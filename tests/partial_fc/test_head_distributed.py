"""PartialFC on 1, 2 and 3 ranks against the single-process full-softmax reference.

One process group per world size runs every case (``_run_cases``) and sends a dict of
results back; the parent computes ``head_reference`` on the same global batch and full weight
matrix (float64) and compares: loss, every head-row gradient, every embedding gradient, the
AdaCos scale over several SGD steps, and class sampling. World size 1 runs in-process with no
process group at all (the single-GPU user).
"""

import math

import head_reference as ref
import pytest
import torch
from spawn import run_ranks

from partial_fc import PartialFC, build_margin
from partial_fc.optim import SampledAdamW, SampledSGD
from partial_fc.sampling import sample_size

C, D = 1001, 16  # uneven over 2 and 3 ranks
LABELS = [0, 333, 334, 500, 501, 667, 668, 1000, 500, 7, 334, 999]  # shard edges, repeats
N = len(LABELS)
UNEVEN = {1: [12], 2: [7, 5], 3: [5, 4, 3]}
CASES = {
    "normface": dict(type="normface", s=8.0),
    "sphereface": dict(type="sphereface", m=4, s=8.0, lambda_base=0.0),
    "sphereface_anneal": dict(type="sphereface", m=4, s=8.0, lambda_base=5.0, lambda_min=1.0),
    "cosface": dict(type="cosface", s=16.0, m=0.35),
    "arcface": dict(type="arcface", s=16.0, m=0.5),
    "arcface_easy": dict(type="arcface", s=16.0, m=0.5, easy_margin=True),
    "combined": dict(type="combined", s=16.0, m1=1.2, m2=0.3, m3=0.1),
    "adacos_fixed": dict(type="adacos", adacos="fixed"),
    "adacos_dynamic": dict(type="adacos", adacos="dynamic"),
    "arcface_adacos_dynamic": dict(type="arcface", m=0.5, adacos="dynamic"),
}
STEPS = 5
TILE = 4 * N * 7  # 7-column class chunks at the full batch: several per shard, a partial last
SGD = dict(lr=0.5, momentum=0.9, weight_decay=5e-4)


def _data():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(N, D, generator=g)
    weight = torch.randn(C, D, generator=g)
    # targets far from the origin of theta: some past ArcFace's/combined's fallback angle,
    # some nearly aligned
    weight[0] = -emb[0] + 0.05 * torch.randn(D, generator=g)
    weight[668] = -emb[6] + 0.3 * torch.randn(D, generator=g)
    weight[333] = emb[1] + 0.05 * torch.randn(D, generator=g)
    weight[1000] = emb[7] + 0.5 * torch.randn(D, generator=g)
    return emb, weight, torch.tensor(LABELS)


def _rows(rank, sizes):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _grads(head, emb_local, labels_local):
    emb_local = emb_local.clone().requires_grad_()
    loss = head(emb_local, labels_local)
    loss.backward()
    return dict(loss=loss.item(), stats=dict(head.stats), wgrad=head.weight.grad.to_dense(),
                egrad=emb_local.grad.clone())


def _head(cfg, weight, sample_rate=1.0):
    head = PartialFC(D, C, build_margin(cfg), sample_rate=sample_rate, kernel="torch",
                     max_tile_bytes=TILE)
    with torch.no_grad():
        head.weight.copy_(weight[head.class_start: head.class_start + head.num_local])
    return head


def _run_cases(rank: int, world: int) -> dict:
    emb, weight, labels = _data()
    even = _rows(rank, [N // world] * world)
    out = {}
    for name, cfg in CASES.items():
        head = _head(cfg, weight)
        out[name] = _grads(head, emb[even], labels[even])
        out[name]["start"] = head.class_start
    uneven = _rows(rank, UNEVEN[world])
    out["uneven_batch"] = _grads(_head(CASES["arcface"], weight), emb[uneven], labels[uneven])
    # batch size 1 per rank, from the well-conditioned tail of the batch (sample 1's target is
    # nearly aligned: ArcFace's d/dcos ~ 1/sin(theta) amplifies fp32 rounding past 1e-5 there)
    one = slice(N - world + rank, N - world + rank + 1)
    out["batch1"] = _grads(_head(CASES["arcface_adacos_dynamic"], weight), emb[one], labels[one])
    out["errors"] = _errors(rank, world, emb[even], labels[even], weight)
    out["angles"] = _head(CASES["cosface"], weight).angle_sample(emb[uneven], labels[uneven],
                                                                 per_rank=200)
    for name in ("adacos_dynamic", "arcface_adacos_dynamic"):  # s over several SGD steps
        head = _head(CASES[name], weight)
        opt = SampledSGD(head.weight, **SGD)
        e = emb[even].clone().requires_grad_()
        scales = []
        for _ in range(STEPS):
            opt.zero_grad()
            e.grad = None
            head(e, labels[even]).backward()
            scales.append(head.stats["scale"])
            opt.step(head.pop_sampled_rows())
            with torch.no_grad():
                e -= SGD["lr"] * e.grad
        out[name + "_steps"] = dict(scales=scales, weight=head.weight.detach().clone())
    for name, opt_cls, cfg in (("sampled_sgd", SampledSGD, CASES["arcface_adacos_dynamic"]),
                               ("sampled_adamw", SampledAdamW, CASES["cosface"])):
        head = _head(cfg, weight, sample_rate=0.1)
        opt = opt_cls(head.weight, lr=0.1)
        res = _grads(head, emb[even], labels[even])
        before = head.weight.detach().clone()
        opt.step(head.pop_sampled_rows())
        res.update(start=head.class_start, index=head.sampled_index.clone(), before=before,
                   after=head.weight.detach().clone())
        out[name] = res
    return out


def _errors(rank, world, emb, labels, weight):
    """A bad input on ONE rank must make every rank raise (nobody left in a collective)."""
    head, msgs = _head(CASES["cosface"], weight), []
    bad = labels.clone()
    if rank == world - 1:
        bad[-1] = C
    for args in ((emb, bad), (emb[:, :3] if rank == 0 else emb, labels)):
        try:
            head(*args)
            msgs.append(None)
        except ValueError as err:
            msgs.append(str(err))
    head(emb, labels)  # the group is still usable afterwards
    return msgs


def _check(world: int, results: list[dict]) -> None:
    emb, weight, labels = _data()
    for name, cfg in CASES.items():
        _check_case(name, cfg, world, results, emb, weight, labels)
    _check_case("uneven_batch", CASES["arcface"], world, results, emb, weight, labels)
    _check_case("batch1", CASES["arcface_adacos_dynamic"], world, results, emb[N - world:],
                weight, labels[N - world:])
    for r in results:
        label_msg, shape_msg = r["errors"]
        assert label_msg == f"PartialFC: label {C} out of range [0, {C}) (num_classes={C})"
        assert shape_msg.startswith("PartialFC: rank 0 passed bad inputs"), shape_msg
    _check_angles(world, results, emb, weight, labels)
    for name in ("adacos_dynamic", "arcface_adacos_dynamic"):
        _check_steps(name, world, results, emb, weight, labels)
    for name, cfg in (("sampled_sgd", CASES["arcface_adacos_dynamic"]),
                      ("sampled_adamw", CASES["cosface"])):
        _check_sampling(name, cfg, results, emb, weight, labels)


def _check_angles(world, results, emb, weight, labels):
    """PartialFC.angle_sample: gathered targets = all N target angles, non-targets drawn from
    the non-target angles only, identical on all ranks."""
    got = results[0]["angles"]
    for r in results[1:]:
        assert all(torch.equal(r["angles"][k], v) for k, v in got.items())
    theta = torch.rad2deg(torch.acos(ref.cosines(emb.double(), weight.double()).clamp(-1, 1)))
    target = theta[torch.arange(N), labels]
    torch.testing.assert_close(got["theta_target"].double().sort().values, target.sort().values,
                               rtol=0, atol=1e-3)
    theta[torch.arange(N), labels] = float("nan")
    nontarget = got["theta_nontarget"].double()
    assert 190 * world <= len(nontarget) <= 200 * world
    gap = (nontarget[:, None] - theta.flatten()[None]).abs().nan_to_num(float("inf"))
    assert gap.min(dim=1).values.max() < 1e-3


def _same_on_all_ranks(results, name):
    for res in results[1:]:
        assert res[name]["stats"] == results[0][name]["stats"], name
        assert res[name]["loss"] == results[0][name]["loss"], name


def _reference_scale(cfg, cos, labels, num_classes=C):
    if cfg.get("adacos") is None:
        return cfg["s"]
    s0 = math.sqrt(2) * math.log(C - 1)
    if cfg["adacos"] == "fixed":
        return s0
    return ref.adacos_scale(cos, labels, s0, num_classes)


def _check_case(name, cfg, world, results, emb, weight, labels):
    _same_on_all_ranks(results, name)
    e, w = emb.double().requires_grad_(), weight.double().requires_grad_()
    s = _reference_scale(cfg, ref.cosines(e, w), labels)
    loss = ref.loss(e, w, labels, cfg, s)
    loss.backward()
    got = results[0][name]
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-5), name
    assert got["stats"]["scale"] == pytest.approx(s, rel=1e-5), name
    assert got["stats"]["loss"] == got["loss"]
    wgrad = torch.cat([r[name]["wgrad"] for r in results]).double()
    egrad = torch.cat([r[name]["egrad"] for r in results]).double()
    tol = dict(rtol=1e-5, atol=1e-5 * w.grad.abs().max().item())
    torch.testing.assert_close(wgrad, w.grad, **tol, msg=name)
    tol = dict(rtol=1e-5, atol=1e-5 * e.grad.abs().max().item())
    torch.testing.assert_close(egrad, e.grad, **tol, msg=name)
    cos_t = ref.cosines(emb.double(), weight.double())[torch.arange(len(labels)), labels]
    assert got["stats"]["cos_target_mean"] == pytest.approx(cos_t.mean().item(), rel=1e-5)
    theta_med = torch.median(torch.acos(cos_t)).item()
    assert got["stats"]["theta_med"] == pytest.approx(theta_med, rel=1e-5)


def _check_steps(name, world, results, emb, weight, labels):
    cfg = CASES[name]
    scales = [r[name + "_steps"]["scales"] for r in results]
    assert all(sc == scales[0] for sc in scales), f"{name}: s differs between ranks"
    e, w = emb.double().clone().requires_grad_(), weight.double().clone().requires_grad_()
    opt = torch.optim.SGD([w], **SGD)
    s = math.sqrt(2) * math.log(C - 1)
    for step in range(STEPS):
        opt.zero_grad()
        e.grad = None
        s = ref.adacos_scale(ref.cosines(e, w), labels, s, C)
        assert scales[0][step] == pytest.approx(s, rel=1e-5), f"{name} step {step}"
        ref.loss(e, w, labels, cfg, s).backward()
        opt.step()
        with torch.no_grad():
            e -= SGD["lr"] * e.grad
    final = torch.cat([r[name + "_steps"]["weight"] for r in results]).double()
    torch.testing.assert_close(final, w.detach(), rtol=1e-4, atol=1e-5)


def _check_sampling(name, cfg, results, emb, weight, labels):
    _same_on_all_ranks(results, name)
    kept = []
    for res in (r[name] for r in results):
        n_local = res["before"].shape[0]
        owned = {y - res["start"] for y in LABELS if 0 <= y - res["start"] < n_local}
        idx = res["index"].tolist()
        assert idx == sorted(set(idx)) and owned <= set(idx), name  # positives kept
        assert len(idx) == max(sample_size(0.1, n_local), len(owned)), name
        kept += [res["start"] + i for i in idx]
        mask = torch.zeros(n_local, dtype=torch.bool)
        mask[res["index"]] = True
        assert torch.equal(res["after"][~mask], res["before"][~mask]), name  # bit-identical
        assert (res["after"][mask] != res["before"][mask]).any(dim=1).all(), name
        assert not res["wgrad"][~mask].any(), name
    cls = torch.tensor(kept)
    remap = torch.searchsorted(cls, labels)
    e, w = emb.double().requires_grad_(), weight.double()[cls].requires_grad_()
    s = _reference_scale(cfg, ref.cosines(e, w), remap)
    loss = ref.loss(e, w, remap, cfg, s)
    loss.backward()
    assert results[0][name]["loss"] == pytest.approx(loss.item(), rel=1e-5), name
    assert results[0][name]["stats"]["scale"] == pytest.approx(s, rel=1e-5), name
    egrad = torch.cat([r[name]["egrad"] for r in results]).double()
    torch.testing.assert_close(egrad, e.grad, rtol=1e-5, atol=1e-5 * e.grad.abs().max().item())
    wgrad = torch.cat([r[name]["wgrad"] for r in results]).double()[cls]
    torch.testing.assert_close(wgrad, w.grad, rtol=1e-5, atol=1e-5 * w.grad.abs().max().item())


def test_world_size_one_without_process_group():
    assert not torch.distributed.is_initialized()
    _check(1, [_run_cases(0, 1)])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_equals_single_process(world):
    _check(world, run_ranks(_run_cases, world))
