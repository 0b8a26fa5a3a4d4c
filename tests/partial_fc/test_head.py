"""PartialFC in one process (no process group): edge cases, errors, state, init, autocast.
Exactness against the reference on 1/2/3 ranks is in test_head_distributed.py."""

import math

import head_reference as ref
import pytest
import torch

from partial_fc import PartialFC, build_margin
from partial_fc.init import BLOCK, derive_seed, init_rows_
from partial_fc.partition import split_evenly

MARGINS = {
    "normface": dict(type="normface", s=30.0),
    "sphereface": dict(type="sphereface", m=4, s=30.0),
    "cosface": dict(type="cosface", s=30.0, m=0.35),
    "arcface": dict(type="arcface", s=64.0, m=0.5),
    "arcface_easy": dict(type="arcface", s=64.0, m=0.5, easy_margin=True),
    "combined": dict(type="combined", s=64.0, m1=1.2, m2=0.3, m3=0.1),
    "adacos_dynamic": dict(type="adacos", adacos="dynamic"),
}


def _head(cfg, num_classes=10, dim=4, **kw):
    return PartialFC(dim, num_classes, build_margin(cfg), **kw)


@pytest.mark.parametrize("name", sorted(MARGINS))
def test_cos_exactly_plus_and_minus_one_gives_finite_loss_and_gradients(name):
    head = _head(MARGINS[name])
    basis = torch.eye(4)
    with torch.no_grad():  # rows 0..3 = unit vectors: cos is exactly +-1 and 0
        head.weight.zero_()
        head.weight[:4] = basis
        head.weight[4:8] = -basis
        head.weight[8:] = basis[:2] + basis[2:]
    emb = basis.clone().requires_grad_()
    labels = torch.tensor([0, 5, 2, 7])  # cos(target) = +1, -1, +1, -1
    loss = head(emb, labels)
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(emb.grad).all() and torch.isfinite(head.weight.grad).all()
    assert all(math.isfinite(v) for v in head.stats.values())


def test_batch_size_one_matches_reference():
    cfg = MARGINS["arcface"]
    head = _head(cfg, num_classes=7)
    emb = torch.randn(1, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    loss = head(emb, torch.tensor([3]))
    loss.backward()
    e, w = emb.detach().double().requires_grad_(), head.weight.detach().double().requires_grad_()
    want = ref.loss(e, w, torch.tensor([3]), cfg, 64.0)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    torch.testing.assert_close(emb.grad.double(), e.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("bad", [-1, 10, 12345])
def test_out_of_range_label_names_the_value(bad):
    head = _head(MARGINS["cosface"])
    with pytest.raises(ValueError, match=rf"label {bad} out of range \[0, 10\)"):
        head(torch.randn(3, 4), torch.tensor([0, bad, 1]))


def test_bad_shapes_and_arguments_are_clear_errors():
    head = _head(MARGINS["cosface"])
    with pytest.raises(ValueError, match=r"expected embeddings float \[n, 4\]"):
        head(torch.randn(3, 5), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="labels int64"):
        head(torch.randn(3, 4), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="labels int64"):  # a mask is not class indices
        head(torch.randn(2, 4), torch.tensor([True, False]))
    with pytest.raises(ValueError, match="global batch is empty"):
        head(torch.randn(0, 4), torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"sample_rate=-0.1: must be a finite number >= 0 and"):
        _head(MARGINS["cosface"], sample_rate=-0.1)
    with pytest.raises(ValueError, match="num_classes=2"):
        _head(dict(type="adacos", adacos="fixed"), num_classes=2)
    with pytest.raises(TypeError, match="build_margin"):
        PartialFC(4, 10, margin=None)


def test_int32_labels_are_accepted():
    head = _head(MARGINS["cosface"])
    emb = torch.randn(3, 4)
    a = head(emb, torch.tensor([0, 4, 9], dtype=torch.int32))
    assert a.item() == head(emb, torch.tensor([0, 4, 9])).item()


def test_state_dict_keys_and_adacos_resume():
    head = _head(MARGINS["adacos_dynamic"])
    assert sorted(head.state_dict()) == ["margin.scale.s", "step", "weight"]
    assert list(_head(MARGINS["arcface"]).state_dict()) == ["weight", "step"]
    emb, labels = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 4, 5])
    head(emb, labels)
    fresh = _head(MARGINS["adacos_dynamic"])
    fresh.load_state_dict(head.state_dict())
    assert fresh.stats == {} and int(fresh.step) == 1
    head(emb, labels)
    fresh(emb, labels)
    assert fresh.stats == head.stats


def test_the_next_forward_uses_a_loaded_step():
    """``step`` (SphereFace's lambda anneals with it) lives on the host and travels in
    ``state_dict``: ``load_state_dict`` sets it, also when a parent module loads, and so
    does assigning it; the next forward computes with that step. A state without it is
    refused like a missing buffer."""
    emb = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    labels = torch.arange(6)
    ahead, loaded, nested, written, stale = (_head(MARGINS["sphereface"]) for _ in range(5))
    for _ in range(5):
        ahead(emb, labels)
    for head in (loaded, nested, written, stale):
        head(emb, labels)
    state = ahead.state_dict()
    assert state["step"].dtype == torch.int64 and int(state["step"]) == 5
    loaded.load_state_dict(state)
    torch.nn.ModuleDict({"head": nested}).load_state_dict(
        {f"head.{key}": value for key, value in state.items()})
    written.step = 5
    want = ahead(emb, labels)
    assert not torch.equal(stale(emb, labels), want)  # step 1's lambda gives another loss
    for head in (loaded, nested, written):
        assert torch.equal(head(emb, labels), want)
        assert int(head.step) == 6
    with pytest.raises(RuntimeError, match="Missing key.*step"):
        stale.load_state_dict({"weight": state["weight"]})


def test_eval_freezes_scale_step_and_sampling():
    head = _head(MARGINS["adacos_dynamic"], num_classes=100, sample_rate=0.1)
    emb, labels = torch.randn(8, 4), torch.arange(8)
    head(emb, labels)
    s, step = head.margin.scale.s.clone(), int(head.step)
    assert head.sampled_index is not None and len(head.sampled_index) == 10
    head.eval()
    with torch.no_grad():
        head(emb, labels)
    assert torch.equal(head.margin.scale.s, s) and int(head.step) == step
    assert head.sampled_index is None and head.stats["scale"] == s.item()


def test_stats_are_floats_with_the_documented_keys():
    head = _head(MARGINS["arcface"])
    head(torch.randn(5, 4), torch.tensor([0, 1, 2, 3, 4]))
    keys = {"scale", "theta_med", "b_avg", "loss", "cos_target_mean", "cos_nontarget_mean"}
    assert set(head.stats) == keys and all(type(v) is float for v in head.stats.values())


def test_fixed_scale_b_avg_stat_is_the_definition():
    torch.manual_seed(0)  # independent of the order pytest-xdist runs tests in
    head = _head(MARGINS["cosface"])
    emb, labels = torch.randn(5, 4), torch.tensor([0, 1, 2, 3, 9])
    head(emb, labels)
    cos = ref.cosines(emb.double(), head.weight.detach().double())
    onehot = torch.nn.functional.one_hot(labels, 10).bool()
    want = torch.exp(30.0 * cos).masked_fill(onehot, 0).sum(1).mean().item()
    assert head.stats["b_avg"] == pytest.approx(want, rel=1e-4)
    nontarget = cos.masked_select(~onehot).mean().item()
    # A mean of cosines can be ~1e-4 (cancellation): fp32 cosines are exact to ~1e-7 absolute,
    # so a purely relative tolerance would test rounding, not the definition.
    assert head.stats["cos_nontarget_mean"] == pytest.approx(nontarget, rel=1e-5, abs=1e-6)


def test_split_evenly_is_contiguous_and_remainder_aware():
    parts = [split_evenly(1001, 3, r) for r in range(3)]
    assert parts == [(0, 334), (334, 668), (668, 1001)]
    assert [split_evenly(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_init_rows_depend_only_on_seed_and_global_class():
    num_classes = 2 * BLOCK + 37
    full = init_rows_(torch.empty(num_classes, 3), 0, seed=5)
    for world in (2, 3, 7):
        parts = [split_evenly(num_classes, world, r) for r in range(world)]
        rows = [init_rows_(torch.empty(stop - start, 3), start, seed=5) for start, stop in parts]
        assert torch.equal(torch.cat(rows), full), world
    assert not torch.equal(init_rows_(torch.empty(10, 3), 0, seed=6), full[:10])
    assert full.std().item() == pytest.approx(0.01, rel=0.05)
    head = PartialFC(3, num_classes, build_margin(MARGINS["cosface"]), seed=5)
    assert torch.equal(head.weight.detach(), full)
    # The blocks are drawn in parallel threads, each from its own generator: the block of
    # row k, not the thread count or the order the threads finish in, fixes it.
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(init_rows_(torch.empty(num_classes, 3), 0, seed=5), full), n
    finally:
        torch.set_num_threads(threads)
    expected = torch.randn(BLOCK, 3, generator=torch.Generator().manual_seed(
        derive_seed(5, 1))) * 0.01  # the definition: block b from its own seeded generator
    assert torch.equal(full[BLOCK: 2 * BLOCK], expected)


def test_the_weight_is_created_on_the_device_it_is_given():
    """What launch.train passes (the run's device); the meta device stands in for a GPU here
    (a CUDA test checks the values): the shard is never built on the CPU first."""
    head = PartialFC(3, BLOCK + 37, build_margin(MARGINS["cosface"]), device="meta")
    assert head.weight.device.type == "meta" and head.weight.shape == (BLOCK + 37, 3)


@pytest.mark.half
def test_bf16_init_is_the_fp32_init_rounded_on_any_number_of_ranks():
    num_classes = BLOCK + 37
    full = init_rows_(torch.empty(num_classes, 3), 0, seed=5).bfloat16()
    head = PartialFC(3, num_classes, build_margin(MARGINS["cosface"]), seed=5,
                     state_dtype=torch.bfloat16)
    assert head.weight.dtype == torch.bfloat16 and torch.equal(head.weight.detach(), full)
    for world in (2, 3):  # what the head of each rank calls for its block
        parts = [split_evenly(num_classes, world, r) for r in range(world)]
        rows = [init_rows_(torch.empty(stop - start, 3, dtype=torch.bfloat16), start, seed=5)
                for start, stop in parts]
        assert torch.equal(torch.cat(rows), full), world
    with pytest.raises(ValueError, match="state_dtype=torch.float16 must be one of"):
        _head(MARGINS["cosface"], state_dtype=torch.float16)


@pytest.mark.half
@pytest.mark.parametrize("rate", [1.0, 0.5])
@pytest.mark.parametrize("name", ["arcface", "adacos_dynamic"])
def test_bf16_state_equals_the_fp32_head_on_the_rounded_rows_under_bf16_autocast(name, rate):
    """A bf16 head multiplies bf16-rounded embeddings and rows with fp32 accumulation, as an
    fp32 head holding the same (bf16-valued) rows does under bf16 autocast: the same loss,
    stats and embedding gradient bit for bit, and the bf16 weight gradient is the fp32 one
    rounded once (to nearest). Both on the torch path, 3 class chunks."""
    g = torch.Generator().manual_seed(5)
    emb, labels = torch.randn(9, 16, generator=g), torch.randint(0, 50, (9,), generator=g)
    kw = dict(num_classes=50, dim=16, sample_rate=rate, kernel="torch", seed=2,
              max_tile_bytes=4 * 9 * 20)
    narrow = _head(MARGINS[name], state_dtype=torch.bfloat16, **kw)
    wide = _head(MARGINS[name], **kw)
    assert narrow.weight.dtype == torch.bfloat16
    with torch.no_grad():
        wide.weight.copy_(narrow.weight)
    for step in range(2):  # the second step: dynamic AdaCos has moved its scale
        x_n, x_w = emb.clone().requires_grad_(), emb.clone().requires_grad_()
        loss_n = narrow(x_n, labels)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_w = wide(x_w, labels)
        loss_n.backward()
        loss_w.backward()
        assert loss_n.item() == loss_w.item() and narrow.stats == wide.stats, step
        assert torch.equal(x_n.grad, x_w.grad), step
        grad_n, grad_w = narrow.weight.grad, wide.weight.grad
        assert grad_n.dtype == torch.bfloat16 and grad_n.is_sparse == (rate < 1)
        assert torch.equal(grad_n.to_dense(), grad_w.to_dense().bfloat16()), step
        narrow.weight.grad = wide.weight.grad = None


@pytest.mark.half
def test_bf16_state_without_autocast_is_within_the_rounding_bound():
    """Against the fp32 head on the same rows in plain fp32, the bf16 head's only difference
    is the embeddings rounded to bf16 (relative ``u = 2**-8`` per element, so ``||de|| <= u``
    and each cosine ``e . w_hat`` moves by at most ``u``): every logit moves by at most
    ``s u`` (CosFace's ``psi(c) = c - m`` has slope 1), so the log-sum-exp and the target
    logit do too, and the loss by at most ``2 s u`` (plus fp32 summation noise, ~1e-6)."""
    g = torch.Generator().manual_seed(6)
    emb, labels = torch.randn(9, 16, generator=g), torch.randint(0, 50, (9,), generator=g)
    narrow = _head(MARGINS["cosface"], num_classes=50, dim=16, state_dtype=torch.bfloat16)
    wide = _head(MARGINS["cosface"], num_classes=50, dim=16)
    with torch.no_grad():
        wide.weight.copy_(narrow.weight)
    gap = abs(narrow(emb, labels).item() - wide(emb, labels).item())
    assert 0 < gap <= 2 * 30.0 * 2.0**-8 + 1e-5  # s = 30


def test_pop_sampled_rows_is_the_union_of_the_forwards_since_the_last_pop():
    head = _head(MARGINS["cosface"], num_classes=200, sample_rate=0.1)
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(6, 4, generator=g), torch.randint(0, 200, (6,), generator=g))
               for _ in range(3)]
    first = head.pop_sampled_rows()
    assert first.empty and first.index.numel() == 0 and first.forwards == 0  # no forward yet
    head(*batches[0])
    one = head.pop_sampled_rows()
    assert one.index is head.sampled_index and one.forwards == 1  # its index, no copy
    assert one.pop == first.pop + 1 and one.weight is head.weight
    used = []
    for e, y in batches:  # gradient accumulation: three forwards, then one step
        head(e, y)
        used.append(head.sampled_index)
    with torch.no_grad():
        head(*batches[0])  # no gradient, so no row to update
    assert not torch.equal(used[0], used[1])
    three = head.pop_sampled_rows()
    assert torch.equal(three.index, torch.unique(torch.cat(used))) and three.forwards == 3
    assert head.pop_sampled_rows().empty
    head.eval()
    head(*batches[0])  # eval with grad: every row
    head.train()
    head(*batches[1])
    assert head.pop_sampled_rows().index is None
    small = _head(MARGINS["cosface"], num_classes=10, sample_rate=0.5)
    for e, y in batches * 3:  # 5 of 10 rows each time: together all of them
        small(e, y % 10)
    assert small.pop_sampled_rows().index is None


@pytest.mark.half
def test_bf16_autocast_keeps_the_softmax_in_fp32():
    head = _head(MARGINS["arcface"], num_classes=50, dim=16)
    emb = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(8) * 5
    want = head(emb, labels).item()
    x = emb.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = head(x, labels)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(x.grad).all()
    assert loss.item() == pytest.approx(want, rel=2e-2)  # bf16 cosines, fp32 softmax


def test_adacos_scale_does_not_drift_with_the_sample_rate():
    num_classes = 2000
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(32, 16, generator=g)
    labels = torch.randint(0, num_classes, (32,), generator=g)
    # One sampled step's s is a random estimate (seed to seed it moves up to 2 % at r=0.05,
    # with any uniform sampler); its ratio to the full s, averaged over 8 seeds (which seed
    # both the init and the sampler), must be 1.
    ratios = {0.3: [], 0.05: []}
    for seed in range(1, 9):
        scale = {}
        for rate in (1.0, 0.3, 0.05):
            head = PartialFC(16, num_classes, build_margin(MARGINS["adacos_dynamic"]),
                             sample_rate=rate, seed=seed)
            head(emb, labels)
            scale[rate] = head.stats["scale"]
        for rate, got in ratios.items():
            got.append(scale[rate] / scale[1.0])
    for rate, got in ratios.items():  # without the (C-1)/(S-1) rescale: ~ln(1/r)/cos lower
        assert sum(got) / len(got) == pytest.approx(1.0, rel=0.01), rate


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu_and_bf16_autocast_is_fp32_softmax():
    cfg = dict(type="arcface", m=0.5, adacos="dynamic")
    g = torch.Generator().manual_seed(0)
    emb, labels = torch.randn(16, 32, generator=g), torch.randint(0, 500, (16,), generator=g)
    cpu, gpu = PartialFC(32, 500, build_margin(cfg)), PartialFC(32, 500, build_margin(cfg))
    gpu = gpu.to("cuda")
    x_cpu, x_gpu = emb.clone().requires_grad_(), emb.to("cuda").requires_grad_()
    cpu(x_cpu, labels).backward()
    gpu(x_gpu, labels.to("cuda")).backward()
    assert gpu.stats["loss"] == pytest.approx(cpu.stats["loss"], rel=1e-4)
    torch.testing.assert_close(x_gpu.grad.cpu(), x_cpu.grad, rtol=1e-4, atol=1e-6)
    sampled = PartialFC(32, 500, build_margin(cfg), sample_rate=0.1).to("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = sampled(x_gpu, labels.to("cuda"))
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(x_gpu.grad).all()
    assert sampled.sampled_index.is_cuda and len(sampled.sampled_index) == 50


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_created_on_the_device_equals_the_cpu_init(dtype):
    """``device=`` draws the rows on the CPU block by block and copies each into the device
    weight: the same values as a CPU-built head moved there, with no whole shard on the host."""
    kwargs = dict(seed=5, state_dtype=dtype)
    on_gpu = PartialFC(3, 2 * BLOCK + 37, build_margin(MARGINS["cosface"]), device="cuda",
                       **kwargs)
    on_cpu = PartialFC(3, 2 * BLOCK + 37, build_margin(MARGINS["cosface"]), **kwargs)
    assert on_gpu.weight.is_cuda and on_gpu.weight.dtype == dtype
    assert torch.equal(on_gpu.weight.detach().cpu(), on_cpu.weight.detach())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_state_on_cuda_matches_the_cpu_torch_path():
    """The bf16 head on CUDA (the Triton kernels when installed, which round ``grad_w`` in
    their epilogue) against the CPU torch path on the same bf16 rows: the same operands and
    fp32 sums, so the loss within 1e-4; the kernels also round ``dL/dcos inv`` to bf16 before
    the backward matmuls (autocast's convention; the torch path keeps it fp32), so both
    gradients within 2**-5 of their largest entry (test_tiles' 16-bit bound, ~3e-2;
    the interpreter gives 0.2-0.6 %). Sampled (r = 0.3; CUDA draws other rows than the CPU):
    a bf16 row-sparse gradient, and an SGD step keeps the state in bf16 and leaves unsampled
    rows alone."""
    from partial_fc import SampledSGD

    g = torch.Generator().manual_seed(1)
    emb, labels = torch.randn(64, 32, generator=g), torch.randint(0, 500, (64,), generator=g)
    bf16 = dict(state_dtype=torch.bfloat16)
    cpu = PartialFC(32, 500, build_margin(MARGINS["arcface"]), kernel="torch", **bf16)
    gpu = PartialFC(32, 500, build_margin(MARGINS["arcface"]), **bf16).to("cuda")
    x_cpu, x_gpu = emb.clone().requires_grad_(), emb.to("cuda").requires_grad_()
    cpu(x_cpu, labels).backward()
    gpu(x_gpu, labels.to("cuda")).backward()
    assert gpu.stats["loss"] == pytest.approx(cpu.stats["loss"], rel=1e-4)
    assert gpu.weight.grad.dtype == torch.bfloat16
    for got, want in ((x_gpu.grad, x_cpu.grad), (gpu.weight.grad, cpu.weight.grad)):
        got, want = got.float().cpu(), want.float()
        assert float((got - want).abs().max()) <= 2**-5 * float(want.abs().max())
    sampled = PartialFC(32, 500, build_margin(MARGINS["arcface"]), sample_rate=0.3,
                        **bf16).to("cuda")
    before = sampled.weight.detach().clone()
    sampled(x_gpu, labels.to("cuda")).backward()
    assert sampled.weight.grad.is_sparse and sampled.weight.grad.dtype == torch.bfloat16
    opt = SampledSGD(sampled.weight, lr=0.1)
    opt.step(sampled.pop_sampled_rows())
    assert opt.state[sampled.weight]["momentum_buffer"].dtype == torch.bfloat16
    others = torch.ones(500, dtype=torch.bool, device="cuda")
    others[sampled.sampled_index] = False
    assert torch.equal(sampled.weight[others], before[others])


def test_angle_sample_measures_targets_and_only_non_targets():
    head = _head(MARGINS["cosface"], num_classes=10, dim=4)
    labels = torch.tensor([3, 7, 3, 0, 9])
    emb = head.weight.detach()[labels] * 2.0  # every target at angle 0
    before = {k: v.clone() for k, v in head.state_dict().items()}
    got = head.angle_sample(emb, labels, per_rank=300)
    assert torch.allclose(got["theta_target"], torch.zeros(5), atol=0.1)
    theta = torch.rad2deg(torch.acos(ref.cosines(emb, head.weight.detach()).clamp(-1, 1)))
    theta[torch.arange(5), labels] = float("nan")  # targets must never be drawn
    nontarget = got["theta_nontarget"]
    assert 200 < len(nontarget) <= 300  # 300 draws, about 1 in 10 hits a target
    gap = (nontarget[:, None] - theta.flatten()[None]).abs().nan_to_num(float("inf"))
    assert gap.min(dim=1).values.max() < 1e-3  # each is one of the non-target angles
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("name", ["sphereface", "arcface", "adacos_dynamic"])
def test_class_chunk_size_does_not_change_loss_gradients_or_stats(name):
    """The torch path's memory budget only changes how the classes are swept: 1, 7 (a
    partial last chunk) and all 50 columns per chunk give the same step, sampled or not."""
    g = torch.Generator().manual_seed(4)
    emb, labels = torch.randn(9, 8, generator=g), torch.randint(0, 50, (9,), generator=g)
    runs = []
    for cols in (1, 7, 50):
        for rate in (1.0, 0.5):
            head = _head(MARGINS[name], num_classes=50, dim=8, sample_rate=rate,
                         kernel="torch", max_tile_bytes=4 * 9 * cols)
            x = emb.clone().requires_grad_()
            head(x, labels).backward()
            runs.append((rate, head.stats, x.grad, head.weight.grad.to_dense()))
    for rate, stats, egrad, wgrad in runs[2:]:  # fp32 sums in another order: s = 64 and
        want = runs[rate != 1.0]  # ArcFace's psi' amplify the cosines' last-bit differences
        assert stats == pytest.approx(want[1], rel=1e-5)
        for got, exp in ((egrad, want[2]), (wgrad, want[3])):
            scale = exp.abs().max().item()
            torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4 * scale)


def test_kernel_and_tile_budget_arguments_are_checked():
    with pytest.raises(ValueError, match="kernel='cuda' must be one of"):
        _head(MARGINS["cosface"], kernel="cuda")
    with pytest.raises(ValueError, match="max_tile_bytes=0 must be >= 1"):
        _head(MARGINS["cosface"], max_tile_bytes=0)



def test_stats_keys_are_the_metric_names_and_global_stats_is_frozen():
    """``stats`` maps exactly the names of ``partial_fc.metric_names`` (the trainer's log
    records and figures read them by these names) to floats; ``global_stats``' result is a
    frozen value, not a dict to mutate."""
    import dataclasses

    from partial_fc.batch_stats import GlobalStats
    from partial_fc.metric_names import HEAD_STATS

    head = _head(MARGINS["cosface"], num_classes=20)
    g = torch.Generator().manual_seed(3)
    head(torch.randn(6, 4, generator=g), torch.randint(0, 20, (6,), generator=g))
    assert sorted(head.stats) == sorted(HEAD_STATS)
    assert all(isinstance(v, float) for v in head.stats.values())
    stats = GlobalStats(*[torch.zeros(())] * 6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.log_b_avg = None
