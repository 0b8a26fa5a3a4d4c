"""partial_fc.optim: equal to torch's SGD/AdamW when all rows are sampled; unsampled rows
and their state untouched; per-row Adam step counts; LR schedulers; state_dict."""

import dataclasses

import pytest
import torch
from host_reads import HostReads

from partial_fc import PartialFC, SampledAdamW, SampledSGD, build_margin


def _head(rate=1.0, num_classes=40):
    return PartialFC(8, num_classes, build_margin(dict(type="cosface", s=16.0, m=0.2)),
                     sample_rate=rate, seed=3)


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 8, generator=g), torch.randint(0, 40, (6,), generator=g)


@pytest.mark.parametrize(
    ("ours", "theirs", "kw"),
    [
        (SampledSGD, torch.optim.SGD, dict(lr=0.3, momentum=0.9, weight_decay=5e-4)),
        (SampledSGD, torch.optim.SGD, dict(lr=0.3, momentum=0.0, weight_decay=0.0)),
        (SampledAdamW, torch.optim.AdamW, dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.05)),
    ],
)
def test_full_sampling_equals_torch_optimizer(ours, theirs, kw):
    head = _head()
    twin = torch.nn.Parameter(head.weight.detach().clone())
    opt, ref = ours(head.weight, **kw), theirs([twin], **kw)
    for step in range(4):
        emb, labels = _batch(step)
        opt.zero_grad()
        head(emb, labels).backward()
        opt.step(head.pop_sampled_rows())
        ref.zero_grad()
        _twin_loss(head, twin, emb, labels).backward()
        ref.step()
        torch.testing.assert_close(head.weight.detach(), twin.detach(), rtol=1e-6, atol=1e-7)


def _twin_loss(head, twin, emb, labels):
    saved = head.weight
    head.weight = twin  # same math, plain parameter
    try:
        return head(emb, labels)
    finally:
        head.weight = saved


@pytest.mark.parametrize("cls", [SampledSGD, SampledAdamW])
def test_unsampled_rows_and_their_state_stay_bit_identical(cls):
    head = _head(rate=0.25)
    opt = cls(head.weight, lr=0.1)
    sampled = torch.zeros(40)
    for step in range(3):
        emb, labels = _batch(step)
        before = head.weight.detach().clone()
        state_before = {k: v.clone() for k, v in opt.state[head.weight].items()}
        assert state_before or step == 0  # the state check below runs from the second step
        opt.zero_grad()
        head(emb, labels).backward()
        used = head.sampled_index
        opt.step(head.pop_sampled_rows())
        mask = torch.zeros(40, dtype=torch.bool)
        mask[used] = True
        sampled += mask
        assert torch.equal(head.weight[~mask], before[~mask])
        assert (head.weight[mask] != before[mask]).any(dim=1).all()
        for key, val in state_before.items():
            assert torch.equal(opt.state[head.weight][key][~mask], val[~mask]), key
    if cls is SampledAdamW:
        # A row's step count is the number of steps that sampled it (its bias correction).
        counts = opt.state[head.weight]["step"]
        assert torch.equal(counts.reshape(-1), sampled) and (sampled < 3).any(), counts


def test_no_forward_since_the_last_step_updates_nothing():
    head = _head(rate=0.25)
    opt = SampledSGD(head.weight, lr=0.1)
    emb, labels = _batch(0)
    head(emb, labels).backward()
    opt.step(head.pop_sampled_rows())
    before = head.weight.detach().clone()
    opt.step(head.pop_sampled_rows())  # no new forward: no row was used
    assert torch.equal(head.weight, before)


def test_lr_scheduler_and_state_dict():
    head = _head()
    opt = SampledSGD(head.weight, lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    emb, labels = _batch(0)
    head(emb, labels).backward()
    opt.step(head.pop_sampled_rows())
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5
    clone = SampledSGD(_head().weight, lr=1.0)
    clone.load_state_dict(opt.state_dict())
    assert torch.equal(next(iter(clone.state.values()))["momentum_buffer"],
                       opt.state[head.weight]["momentum_buffer"])


def test_the_hand_off_refuses_stale_foreign_or_missing_rows():
    """``step(rows)`` takes the value of this step's pop: the same value twice, an older one
    after a newer was taken, another head's rows, or no value at all raise, and none of these
    moves a row."""
    head, other = _head(rate=0.25), _head(rate=0.25)
    opt = SampledSGD(head.weight, lr=0.1)
    head(*_batch(0)).backward()
    old = head.pop_sampled_rows()
    opt.zero_grad()
    head(*_batch(1)).backward()
    new = head.pop_sampled_rows()
    assert new.pop == old.pop + 1 and new.forwards == 1
    opt.step(new)
    before = head.weight.detach().clone()
    for stale in (new, old):
        with pytest.raises(ValueError, match="stale rows"):
            opt.step(stale)
    other(*_batch(0)).backward()
    with pytest.raises(ValueError, match="another head"):
        opt.step(other.pop_sampled_rows())
    with pytest.raises(TypeError):
        opt.step()
    with pytest.raises(TypeError, match="pop_sampled_rows"):
        opt.step(new.index)
    assert torch.equal(head.weight, before)


def test_a_skipped_step_without_pop_cannot_leak_its_rows_into_the_next():
    """The rows of a step whose gradient was dropped (``zero_grad``) must be popped before the
    next forward: otherwise the next step would move them (weight decay, momentum) though
    they had no gradient, so the head refuses the forward instead."""
    head = _head(rate=0.25)
    opt = SampledSGD(head.weight, lr=0.1)
    head(*_batch(2)).backward()
    opt.step(head.pop_sampled_rows())  # a loop that pops ...
    opt.zero_grad()
    head(*_batch(0)).backward()
    opt.zero_grad()  # ... skips a step ...
    with pytest.raises(RuntimeError, match="pop_sampled_rows"):
        head(*_batch(1))  # ... and forgot to pop its rows
    head.pop_sampled_rows()  # dropped: the skipped step's rows are not updated
    head(*_batch(1)).backward()
    used = head.sampled_index
    before = head.weight.detach().clone()
    opt.step(head.pop_sampled_rows())
    moved = (head.weight != before).any(dim=1)
    assert torch.equal(moved.nonzero().squeeze(1), used)


def test_argument_errors():
    with pytest.raises(TypeError, match="PartialFC"):
        SampledSGD(torch.nn.Linear(2, 2), lr=0.1)
    with pytest.raises(ValueError, match="momentum=1.5"):
        SampledSGD(_head().weight, lr=0.1, momentum=1.5)
    with pytest.raises(ValueError, match="lr=-1"):
        SampledAdamW(_head().weight, lr=-1)


def _adamw_round_trip(device: str, saved_step_dtype: torch.dtype) -> SampledAdamW:
    head = _head(rate=0.2)
    opt = SampledAdamW(head.weight, lr=0.01)
    head(*_batch(0)).backward()
    opt.step(head.pop_sampled_rows())
    saved = opt.state_dict()
    saved["state"][0]["step"] = saved["state"][0]["step"].to("cpu", saved_step_dtype)
    clone_head = _head(rate=0.2).to(device)
    clone = SampledAdamW(clone_head.weight, lr=0.01)
    clone.load_state_dict(saved)
    emb, labels = _batch(1)
    clone_head(emb.to(device), labels.to(device)).backward()
    # row-indexes the step counts with indices on the weight's device
    clone.step(clone_head.pop_sampled_rows())
    return clone


def test_adamw_step_counts_follow_the_weight_on_load():
    step = next(iter(_adamw_round_trip("cpu", torch.float64).state.values()))["step"]
    assert step.dtype == torch.float32 and step.max().item() == 2.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_adamw_state_saved_on_cpu_resumes_on_cuda():
    step = next(iter(_adamw_round_trip("cuda", torch.float32).state.values()))["step"]
    assert step.device.type == "cuda"


def test_row_sparse_gradient_of_two_forwards_updates_their_union_once():
    """At r < 1 ``weight.grad`` is a sparse COO tensor; two forwards before one step leave
    duplicate rows, which the optimizer sums; a third forward without backward adds rows with
    no stored gradient (gradient 0, as a dense one would hold). The update is SGD's on the
    union of the samples, and no other row or momentum entry moves."""
    head = _head(rate=0.2)
    opt = SampledSGD(head.weight, lr=0.3, momentum=0.9, weight_decay=5e-4)
    before = head.weight.detach().clone()
    used = []
    for step in range(2):
        emb, labels = _batch(step)
        head(emb, labels).backward()
        used.append(head.sampled_index)
    head(*_batch(2))  # used, never backpropagated
    used.append(head.sampled_index)
    grad = head.weight.grad
    assert grad.is_sparse and grad.coalesce().values().shape[0] < head.num_local
    rows = torch.unique(torch.cat(used))
    assert not torch.equal(used[0], used[1])  # different samples: duplicates and new rows
    assert len(rows) > grad.coalesce().indices().shape[1]  # rows with no stored gradient
    dense = grad.to_dense()
    opt.step(head.pop_sampled_rows())
    want = before.clone()
    want[rows] -= 0.3 * (dense[rows] + 5e-4 * before[rows])
    torch.testing.assert_close(head.weight.detach(), want, rtol=1e-6, atol=1e-7)
    others = torch.ones(head.num_local, dtype=torch.bool).index_fill_(0, rows, False)
    assert torch.equal(opt.state[head.weight]["momentum_buffer"][others],
                       torch.zeros_like(before[others]))


def _sgd(head, **kw):
    return SampledSGD(head.weight, lr=0.3, momentum=0.9, weight_decay=5e-4, **kw)


def _adamw(head, **kw):
    return SampledAdamW(head.weight, lr=0.01, betas=(0.8, 0.99), weight_decay=0.05, **kw)


def _rows_budget(cls, rows: int, dim: int = 8) -> int:
    """``max_update_bytes`` that makes ``rows`` rows a chunk."""
    return rows * cls.temporaries() * dim * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rate", [1.0, 0.25])
@pytest.mark.parametrize("make", [_sgd, _adamw])
def test_chunked_update_is_bit_identical_at_any_chunk_size(make, rate, dtype):
    """1 row, 3 and 7 rows (neither divides the 10 sampled or 40 rows), all at once: the same
    weights and state after three steps, the last one after two forwards (duplicate rows in
    the sparse gradient) and a forward without backward (rows without a stored gradient)."""
    cls = SampledSGD if make is _sgd else SampledAdamW
    runs = []
    for rows in (1, 3, 7, 40):
        head = PartialFC(8, 40, build_margin(dict(type="cosface", s=16.0, m=0.2)),
                         sample_rate=rate, seed=3, state_dtype=dtype)
        opt = make(head, max_update_bytes=_rows_budget(cls, rows))
        for step in range(3):
            head(*_batch(step)).backward()
            if step == 2:
                head(*_batch(7)).backward()
                head(*_batch(8))
            opt.step(head.pop_sampled_rows())
            opt.zero_grad()
        runs.append((head.weight.detach(), opt.state[head.weight]))
    weight, state = runs[-1]
    assert weight.dtype == dtype and all(v.dtype == dtype for k, v in state.items()
                                         if k != "step")
    for got, got_state in runs[:-1]:
        assert torch.equal(got, weight)
        assert all(torch.equal(got_state[k], v) for k, v in state.items())


@pytest.mark.half
@pytest.mark.parametrize("rate", [1.0, 0.25])
@pytest.mark.parametrize("make", [_sgd, _adamw])
def test_bf16_update_is_the_fp32_update_rounded_once(make, rate):
    """Each step, an fp32 twin starts from the bf16 head's weights, state and gradient
    (widened, exact) and takes the fp32 optimizer's step: the bf16 head then holds exactly
    the twin's weights and state rounded to bf16 (AdamW's fp32 step counts: equal). Chunks
    of 3 rows, so gathered and sliced chunks both write back."""
    cls = SampledSGD if make is _sgd else SampledAdamW
    margin = dict(type="cosface", s=16.0, m=0.2)
    head = PartialFC(8, 40, build_margin(margin), sample_rate=rate, seed=3,
                     state_dtype=torch.bfloat16)
    twin = PartialFC(8, 40, build_margin(margin), sample_rate=rate, seed=3)
    opt = make(head, max_update_bytes=_rows_budget(cls, 3))
    ref = make(twin, max_update_bytes=_rows_budget(cls, 3))
    for step in range(4):
        emb, labels = _batch(step)
        head(emb, labels).backward()
        twin(emb, labels)  # the same sampled rows, recorded for its step
        with torch.no_grad():
            twin.weight.copy_(head.weight)
        twin.weight.grad = head.weight.grad.float()
        if step:
            ref.state[twin.weight] = {k: v.to(torch.float32, copy=True)
                                      for k, v in opt.state[head.weight].items()}
        opt.step(head.pop_sampled_rows())
        ref.step(twin.pop_sampled_rows())
        assert torch.equal(head.weight.detach(), twin.weight.detach().bfloat16()), step
        for key, value in opt.state[head.weight].items():
            want = ref.state[twin.weight][key]
            assert torch.equal(value, want if key == "step" else want.bfloat16()), (step, key)
        opt.zero_grad()
        ref.zero_grad()


def test_state_follows_the_weight_dtype():
    """State restored from a run with another state dtype (trainer.checkpoint.state writes the saved
    tensors into the optimizer as they are) is cast to the weight's dtype at the next step."""
    head = PartialFC(8, 40, build_margin(dict(type="cosface", s=16.0, m=0.2)), seed=3,
                     state_dtype=torch.bfloat16)
    opt = _sgd(head)
    opt.state[head.weight]["momentum_buffer"] = torch.full((40, 8), 0.1)  # fp32
    head(*_batch(0)).backward()
    opt.step(head.pop_sampled_rows())
    assert opt.state[head.weight]["momentum_buffer"].dtype == torch.bfloat16


def test_update_budget_is_checked():
    with pytest.raises(ValueError, match="max_update_bytes=0 must be >= 1"):
        SampledSGD(_head().weight, lr=0.1, max_update_bytes=0)


@pytest.mark.parametrize(("rate", "dense", "dtype", "fuses"), [
    (1.0, False, torch.float32, True),
    (0.25, True, torch.float32, False),  # every row, but a row-sparse gradient
    (1.0, False, torch.bfloat16, False),  # bf16 state: the fp32 round trip, chunked
])
@pytest.mark.parametrize("kw", [dict(momentum=0.9, weight_decay=5e-4),
                                dict(momentum=0.0, weight_decay=0.0)])
def test_fused_whole_weight_sgd_is_bit_identical_to_the_chunked_update(
        monkeypatch, kw, rate, dense, dtype, fuses):
    """``SampledSGD(fused=True)`` takes torch's fused SGD over the whole weight exactly where
    every row has a dense fp32 gradient, and its weights and momentum equal the chunked
    update's (chunks of 7 rows) bit for bit after four steps."""
    import partial_fc.optim as optim

    calls, real = [], optim.sgd
    monkeypatch.setattr(optim, "sgd", lambda *a, **k: calls.append(k["fused"]) or real(*a, **k))
    runs = []
    for fused in (True, False):
        head = PartialFC(8, 40, build_margin(dict(type="cosface", s=16.0, m=0.2)),
                         sample_rate=rate, seed=3, state_dtype=dtype)
        opt = SampledSGD(head.weight, lr=0.3, fused=fused, dense=dense,
                         max_update_bytes=_rows_budget(SampledSGD, 7), **kw)
        for step in range(4):
            head(*_batch(step)).backward()
            opt.step(head.pop_sampled_rows())
            opt.zero_grad()
        runs.append((head.weight.detach(), opt.state[head.weight]["momentum_buffer"]))
    assert calls == [True] * 4 * fuses
    (w_fused, buf_fused), (w_chunked, buf_chunked) = runs
    assert torch.equal(w_fused, w_chunked) and torch.equal(buf_fused, buf_chunked)
    assert not torch.equal(w_fused, _head(rate).weight.to(dtype))  # the steps moved it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", [_sgd, _adamw])
def test_micro_batches_sharing_a_sample_step_without_a_host_read(make, dtype):
    """Three forwards of one ``begin_step`` sample, two backpropagated: their gradients,
    concatenated as CUDA's accumulation leaves them, update the rows with no host read and
    bit for bit as the checked path (sort, sum in fp32 in turn) does."""
    heads = [PartialFC(8, 40, build_margin(dict(type="cosface", s=16.0, m=0.2)),
                       sample_rate=0.25, seed=3, state_dtype=dtype) for _ in range(2)]
    batches = [_batch(step) for step in range(3)]
    head = heads[0]
    head.begin_step(torch.cat([y for _, y in batches]), sizes=[18])
    grads = []
    for i, (emb, labels) in enumerate(batches):
        loss = head(emb, labels, sizes=[6])
        if i < 2:
            head.weight.grad = None
            loss.backward()
            grads.append(head.weight.grad)
    rows = head.pop_sampled_rows()
    assert rows.shared and rows.forwards == 3 and grads[0]._indices().equal(rows.index[None])
    concatenated = torch.sparse_coo_tensor(
        torch.cat([g._indices() for g in grads], dim=1),
        torch.cat([g._values() for g in grads]), head.weight.shape, check_invariants=False)
    before = heads[1].weight.detach().clone()
    opts, reads = [make(h) for h in heads], []
    for h, opt, shared in zip(heads, opts, (True, False), strict=True):
        h.weight.grad = concatenated
        with HostReads() as counted:
            opt.step(dataclasses.replace(rows, weight=h.weight, shared=shared))
        reads.append(len(counted))
    assert reads[0] == 0 < reads[1]
    assert torch.equal(heads[0].weight, heads[1].weight)
    assert not torch.equal(heads[0].weight[rows.index], before[rows.index])
    for key, value in opts[0].state[heads[0].weight].items():
        assert torch.equal(value, opts[1].state[heads[1].weight][key]), key
