"""Host reads of a training step (tests/host_reads.py counts them on CPU).

A read of a device value by the host (``.item()``, ``bool(t)``, ``nonzero``, ...) makes the
CPU wait for the GPU's queue to drain; the budget of a steady-state step is held here so
that a new ``.item()`` on the training path fails a CPU test:

- ``PartialFC.forward`` + backward at ``r = 1`` with ``sizes`` and ``trusted_labels``: 0;
- ``Engine.step``, DDP, ``r = 1`` (with or without gradient accumulation): exactly 1, the
  agreed finite flag (and stop request) that decides whether the optimizers step;
- ``PartialFC`` at ``r < 1``, the same: 0 where ``ceil(r * num_local)`` is at least the
  global batch (the sample's size is then known on the host), else 1, the number of
  positives (``partial_fc.sampling``);
- DDP at ``r < 1``: the one above (``partial_fc.optim`` learns the sampled rows without a
  read: after one forward they are the sampler's index, and the sparse gradient holds exactly
  those), and the sampler's one, here where its sample is smaller than the batch;
- DeepSpeed ZeRO-1 at ``r = 1``: the engine's 1, plus what DeepSpeed's own overflow check
  reads inside ``model.step()`` (2 with DeepSpeed 0.19);
- ``launch.train.one_step``: the engine's 1 on a step that writes no metrics record.

The first step is warm-up (the head reads its step counter once). The cuda-marked tests check
the same with ``torch.cuda.set_sync_debug_mode`` on a GPU.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from host_reads import HostReads
from launch_helpers import build_engine, local_micro_batches, make_config, train_in_process
from spawn import run_ranks

from partial_fc import PartialFC, build_margin

GLOBAL_BATCH = 8
ENGINE = "trainer/engine/backend.py read"  # the verdict's one read (Verdict.read)
DEEPSPEED_STEP = "trainer/engine/deepspeed_backend.py _scaled_step"
SAMPLE_SIZE = "partial_fc/sampling.py _count_positives"  # 3 of 6 or 5 rows, 8 labels
MARGINS = {"arcface": dict(type="arcface", s=64.0, m=0.5),
           "adacos_dynamic": dict(type="adacos", adacos="dynamic"),
           "sphereface": dict(type="sphereface", m=4, s=30.0)}


def _inputs(n=6, dim=8, classes=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g), torch.randint(0, classes, (n,), generator=g)


@pytest.mark.parametrize("name", sorted(MARGINS))
def test_head_step_at_rate_1_with_known_sizes_reads_nothing(name):
    head = PartialFC(8, 20, build_margin(MARGINS[name]), seed=0)
    eager = copy.deepcopy(head)
    emb, labels = _inputs()
    for module in (head, eager):  # warm-up: the first forward reads the step counter
        module(emb, labels).backward()
    x = emb.clone().requires_grad_()
    with HostReads() as reads:
        head(x, labels, sizes=[6], trusted_labels=True).backward()
    assert len(reads) == 0, reads.table()
    x_ref = emb.clone().requires_grad_()
    eager(x_ref, labels).backward()
    with HostReads() as reads:
        stats = dict(head.stats)
    assert len(reads) == 1, reads.table()  # every statistic in one transfer
    assert stats == dict(eager.stats)  # the same floats as the eager path
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(head.weight.grad, eager.weight.grad)


@pytest.mark.parametrize(("rate", "reads"), [(0.5, 0), (0.1, 1)])  # 20 / 4 of 40 rows
def test_head_step_below_rate_1_reads_at_most_the_sample_size(rate, reads):
    """At ``r < 1`` the forward and the sparse backward read no more than at ``r = 1``
    (nothing) when the sample outnumbers the batch's 6 labels, and only the number of
    positives when it may not; with the same sample and gradients as the eager path."""
    head = PartialFC(8, 40, build_margin(MARGINS["arcface"]), sample_rate=rate, seed=0)
    eager = copy.deepcopy(head)
    emb, labels = _inputs(classes=40)
    x = emb.clone().requires_grad_()
    with HostReads() as counted:
        head(x, labels, sizes=[6], trusted_labels=True).backward()
    assert len(counted) == reads, counted.table()
    x_ref = emb.clone().requires_grad_()
    eager(x_ref, labels).backward()
    assert torch.equal(head.sampled_index, eager.sampled_index)
    assert len(head.sampled_index) == max(round(40 * rate), len(labels.unique()))
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(head.weight.grad.to_dense(), eager.weight.grad.to_dense())


def test_only_trusted_labels_skip_the_range_check():
    """The default forward refuses a label out of range on the host; ``trusted_labels`` reads
    nothing and computes a loss for it (no error: hence only for a source that refused such
    labels already, tests/trainer/test_trusted_labels.py)."""
    head = PartialFC(8, 20, build_margin(MARGINS["arcface"]))
    emb, labels = _inputs()
    bad = labels.clone()
    bad[3] = 20
    with pytest.raises(ValueError, match=r"^PartialFC: label 20 out of range \[0, 20\) "
                                         r"\(num_classes=20\)$"):
        head(emb, bad)
    assert torch.isfinite(head(emb, bad, trusted_labels=True))


def test_known_sizes_are_checked_against_the_inputs():
    head = PartialFC(8, 20, build_margin(MARGINS["arcface"]))
    emb, labels = _inputs()
    with pytest.raises(ValueError, match=r"rank 0 passed bad inputs; expected embeddings float "
                                         r"\[5, 8\]"):
        head(emb, labels, sizes=[5])
    with pytest.raises(ValueError, match=r"sizes=\[6, 6\] must be 1 batch sizes"):
        head(emb, labels, sizes=[6, 6])


def test_step_counter_copy_follows_a_loaded_state():
    """The host copy of ``step`` (it seeds the sampler) notices ``load_state_dict``: a head
    that loads another's state samples the same rows at its next forward."""
    ahead, behind = (PartialFC(8, 200, build_margin(MARGINS["arcface"]), sample_rate=0.1)
                     for _ in range(2))
    emb, labels = _inputs(classes=200)
    for _ in range(3):
        ahead(emb, labels)
    behind(emb, labels)
    behind.load_state_dict(ahead.state_dict())
    assert torch.equal(behind(emb, labels), ahead(emb, labels))
    assert torch.equal(behind.sampled_index, ahead.sampled_index)
    assert int(behind.step) == 4


SPECS = {  # name: overrides
    "ddp": ["engine.type=ddp"],
    "ddp_accum": ["engine.type=ddp", "train.grad_accum=2", "train.clip_grad_norm=null"],
    "ddp_sampled": ["engine.type=ddp", "head.sample_rate=0.5"],
    "zero1": ["engine.type=deepspeed", "engine.zero_stage=1"],
}


def _count_steps(rank: int, world: int, specs: dict) -> dict:
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed insists; torchrun sets it
    out = {}
    for name, overrides in specs.items():
        cfg = make_config(*overrides, f"train.batch_size={GLOBAL_BATCH // world // 2}"
                          if "train.grad_accum=2" in overrides
                          else f"train.batch_size={GLOBAL_BATCH // world}")
        k = cfg.train.grad_accum
        engine = build_engine(cfg)
        engine.step(0, local_micro_batches(0, GLOBAL_BATCH, rank, world, k))  # warm-up
        counts = []
        for step in (1, 2):
            with HostReads() as reads:
                stats = engine.step(step, local_micro_batches(step, GLOBAL_BATCH, rank, world, k))
            counts.append((reads.places(), reads.table()))
        with HostReads() as later:
            read = {"loss": stats.loss, "grad_norm": stats.grad_norm,
                    **dict(engine.head.stats)}
        out[name] = {"counts": counts, "later": len(later), "read": read,
                     "skipped": stats.skipped}
    return out


def test_steady_state_steps_keep_their_host_read_budget():
    results = run_ranks(_count_steps, world_size=2, args=(SPECS,))
    for rank, result in enumerate(results):
        for name, r in result.items():
            assert not r["skipped"], (rank, name)
            assert r["later"] == 2, (rank, name)  # engine numbers, head numbers: 1 each
            assert r["read"] == results[0][name]["read"], (rank, name)  # replicated
            for places, table in r["counts"]:
                where = f"rank {rank} {name}:\n{table}"
                if name in ("ddp", "ddp_accum"):
                    assert places == {ENGINE: 1}, where
                elif name == "ddp_sampled":  # the optimizer's rows: no read
                    assert places == {ENGINE: 1, SAMPLE_SIZE: 1}, where
                else:  # DeepSpeed: its overflow check reads inside model.step()
                    assert places[ENGINE] == 1, where
                    assert set(places) <= {ENGINE, DEEPSPEED_STEP}, where


def test_a_training_step_that_logs_nothing_reads_once(synthetic_data, tmp_path, monkeypatch):
    """``launch.train.one_step``: the engine's one read, which also agrees on a stop signal
    (the loop reads nothing else between steps), except on the steps that write a metrics
    record (there: the numbers, the loader's counters)."""
    import trainer.loop as train

    one_step, per_step = train.one_step, []

    def counted(run, micro_batches):
        with HostReads() as reads:
            stop = one_step(run, micro_batches)
        per_step.append((run.step, len(reads), reads.table()))
        return stop

    monkeypatch.setattr(train, "one_step", counted)
    assert train_in_process(synthetic_data, tmp_path / "run", "train.max_steps=6",
                            "log.every=3", "log.hist_every=0") == 0
    assert [s for s, _, _ in per_step] == [1, 2, 3, 4, 5, 6]
    for step, n, table in per_step[1:]:
        if step % 3:
            assert n == 1, f"step {step}:\n{table}"
        else:
            assert n > 1, f"step {step}:\n{table}"


def _cuda_engine():
    import torch.distributed as dist

    os.environ.setdefault("LOCAL_RANK", "0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    return build_engine(make_config("train.batch_size=8", "engine.precision=bf16"),
                        device="cuda:0")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_head_step_on_cuda_never_synchronises():
    head = PartialFC(128, 100_000, build_margin(MARGINS["arcface"])).cuda()
    emb, labels = torch.randn(256, 128, device="cuda"), torch.randint(0, 100_000, (256,),
                                                                      device="cuda")
    head(emb, labels).backward()  # warm-up (and Triton's compilation)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x = emb.clone().requires_grad_()
        head(x, labels, sizes=[256], trusted_labels=True).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_step_on_cuda_synchronises_once():
    """The steady-state DDP step (bf16, pinned batches) synchronises once: the engine's
    agreed flags. ``warn`` rather than ``error``: that one read is intended."""
    import torch.distributed as dist

    engine = _cuda_engine()
    try:
        batches = [[(x.pin_memory(), y.pin_memory())]
                   for x, y in (local_micro_batches(s, 8, 0, 1, 1)[0] for s in range(3))]
        engine.step(0, batches[0])
        engine.step(1, batches[1])
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step(2, batches[2])
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # Not torch's own "Synchronization debug mode is a prototype" notice: the syncs.
        syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
        assert len(syncs) == 1, [f"{w.filename}:{w.lineno} {w.message}" for w in syncs]
        # The verdict's flags read once (Verdict.read, trainer/engine/backend.py).
        assert syncs[0].filename.endswith(os.path.join("trainer", "engine", "backend.py"))
    finally:
        dist.destroy_process_group()
