"""trainer.engine: a P-rank optimisation step equals a 1-rank step on the same global batch.

For DDP and DeepSpeed ZeRO 0/1/2 (fp32 on CPU), two steps each (the second one exercises
momentum), with gradient clipping on: loss, every backbone parameter and every head row
after the steps equal a single-process run. Gradient accumulation (2 micro-batches per
rank) equals the same global batch in one piece.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from launch_helpers import (
    build_engine,
    full_rows,
    local_micro_batches,
    make_config,
    same_snapshots,
    snapshot,
    tiny_batchnorm_backbone,
)
from spawn import run_ranks

GLOBAL_BATCH = 12
SPECS = [  # (engine, zero stage, grad_accum, backbone grad clipping)
    ("ddp", 0, 1, "null"),
    ("ddp", 0, 2, "0.05"),
    ("deepspeed", 0, 1, "null"),
    ("deepspeed", 1, 1, "0.05"),
    ("deepspeed", 2, 2, "null"),
]
REFERENCES = [("ddp", 0, 1, "null"), ("ddp", 0, 1, "0.05")]


def _run(rank: int, world: int, specs: list) -> list:
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed insists; torchrun sets it
    results = []
    for engine_type, stage, k, clip in specs:
        cfg = make_config(
            f"engine.type={engine_type}",
            f"train.clip_grad_norm={clip}",
            f"engine.zero_stage={stage}",
            f"train.grad_accum={k}",
            f"train.batch_size={GLOBAL_BATCH // world // k}",
        )
        engine = build_engine(cfg)
        initial = snapshot(engine)["backbone"]
        losses = [
            engine.step(step, local_micro_batches(step, GLOBAL_BATCH, rank, world, k)).loss
            for step in range(2)
        ]
        results.append({"losses": losses, "initial": initial, **snapshot(engine)})
    return results


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what, rel: float = 1e-4) -> None:
    """Normwise comparison: ``max|a - b| <= rel * max|b| + 1e-6``.

    Each element is a sum of fp32 terms that two ranks accumulate in another order than one
    (partial row sums all-reduced, micro-batches averaged). Its rounding error is bounded by
    about ``n * eps`` times the sum of the terms' magnitudes, which the tensor's largest entry
    bounds, not by the element's own value: where terms cancel (the second step's momentum
    ``g2 + 0.9 g1`` with ``g2 ~ -0.9 g1``) an elementwise rtol fails a correct run (seen:
    4.2e-6 off on an element of 1e-2, in a buffer whose largest entry is 12)."""
    a, b = actual.double(), expected.double()
    err, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert err <= rel * scale + 1e-6, f"{what}: max error {err:.3g}, largest entry {scale:.3g}"


@pytest.mark.slow
def test_two_ranks_equal_one_rank():
    (reference,) = run_ranks(_run, 1, args=(REFERENCES,))
    per_rank = run_ranks(_run, 2, args=(SPECS,), timeout=240)
    for i, spec in enumerate(SPECS):
        ref = reference[REFERENCES.index(("ddp", 0, 1, spec[3]))]
        snaps = [per_rank[r][i] for r in range(2)]
        for snap in snaps:
            assert snap["losses"] == pytest.approx(ref["losses"], rel=1e-5), spec
            for name, value in ref["backbone"].items():
                _assert_close(snap["backbone"][name], value, (spec, name))
        _assert_close(full_rows(snaps), ref["rows"], (spec, "head rows"))
        _assert_close(full_rows(snaps, "momentum_buffer"), ref["head_opt"]["momentum_buffer"],
                      (spec, "head momentum"))
    assert ref["losses"][1] < ref["losses"][0] and all(map(math.isfinite, ref["losses"]))
    for ref in reference:  # sanity: the steps moved the parameters the comparison looked at
        assert any(not torch.equal(v, ref["initial"][k]) for k, v in ref["backbone"].items())


SAMPLED = [  # (engine, zero stage, grad_accum): accumulation against one batch, r = 0.3
    ("ddp", 0, 1), ("ddp", 0, 2), ("deepspeed", 2, 1), ("deepspeed", 2, 2),
]


def _sampled_run(rank: int, world: int) -> list:
    """Three steps at sample rate 0.3 with the margin warming up, per :data:`SAMPLED`."""
    os.environ.setdefault("LOCAL_RANK", "0")
    results = []
    for engine_type, stage, k in SAMPLED:
        cfg = make_config(f"engine.type={engine_type}", f"engine.zero_stage={stage}",
                          f"train.grad_accum={k}", f"train.batch_size={GLOBAL_BATCH // world // k}",
                          "head.sample_rate=0.3", "margin.warmup_steps=3",
                          "train.clip_grad_norm=null")
        engine = build_engine(cfg)
        losses = [engine.step(step, local_micro_batches(step, GLOBAL_BATCH, rank, world, k)).loss
                  for step in range(3)]
        results.append({"losses": losses, **snapshot(engine)})
    return results


@pytest.mark.slow
def test_accumulation_with_class_sampling_equals_one_batch():
    """Two micro-batches per rank share one class sample and one head step (the margin's
    warm-up), so they equal the same global batch in one piece; per-micro-batch sampling
    would keep each micro-batch's positives only and ramp the margin per forward."""
    per_rank = run_ranks(_sampled_run, 2, timeout=240)
    for one, accumulated in ((0, 1), (2, 3)):
        for r in range(2):
            a, b = per_rank[r][accumulated], per_rank[r][one]
            assert a["losses"] == pytest.approx(b["losses"], rel=1e-5), SAMPLED[accumulated]
            assert torch.equal(a["head_state"]["step"], b["head_state"]["step"])
            for name, value in b["backbone"].items():
                _assert_close(a["backbone"][name], value, (SAMPLED[accumulated], name))
            _assert_close(a["rows"], b["rows"], (SAMPLED[accumulated], "head rows"))
            _assert_close(a["head_opt"]["momentum_buffer"], b["head_opt"]["momentum_buffer"],
                          (SAMPLED[accumulated], "head momentum"))


def test_lr_schedule_warmup_then_poly_or_cosine():
    from trainer.config import ScheduleConfig
    from trainer.engine import lr_factor

    poly = lr_factor(ScheduleConfig(type="poly", power=2.0), warmup_steps=4, total_steps=14)
    assert [poly(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert [poly(s) for s in (4, 9, 14, 20)] == pytest.approx([1.0, 0.25, 0.0, 0.0])
    cos = lr_factor(ScheduleConfig(type="cosine"), warmup_steps=0, total_steps=10)
    assert [cos(s) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    assert cos(2) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))


def _bf16_engines(rank: int, world: int) -> dict:
    """DDP under bf16 autocast, DeepSpeed ZeRO-1 bf16 and DDP fp32: same init, same two global
    batches, a real BatchNorm backbone (iresnet_tiny)."""
    from launch_helpers import EMBEDDING, NUM_CLASSES

    from partial_fc import PartialFC, build_margin
    from partial_fc.backbones import build_backbone
    from trainer.dist import attach
    from trainer.engine import Engine

    os.environ.setdefault("LOCAL_RANK", "0")
    out = {}
    for engine_type, precision in (("ddp", "bf16"), ("deepspeed", "bf16"), ("ddp", "fp32")):
        cfg = make_config(f"engine.type={engine_type}", f"engine.precision={precision}",
                          "engine.zero_stage=1", f"train.batch_size={GLOBAL_BATCH // world}")
        torch.manual_seed(0)
        backbone = build_backbone("iresnet_tiny", EMBEDDING)
        head = PartialFC(EMBEDDING, NUM_CLASSES, build_margin(cfg.margin_kwargs()), seed=cfg.seed)
        engine = Engine(cfg, backbone, head, attach(torch.device("cpu")), total_steps=10,
                  warmup_steps=0)
        initial = _flat_params(engine.backbone)
        losses = [engine.step(s, local_micro_batches(s, GLOBAL_BATCH, rank, world, 1)).loss
                  for s in range(2)]
        master = _flat_params(engine.backbone, engine_type == "deepspeed")
        out[f"{engine_type}-{precision}"] = {"losses": losses, "update": master - initial,
                            "rows": engine.head.weight.detach().clone()}
    return out


def _flat_params(module: torch.nn.Module, deepspeed_master: bool = False) -> torch.Tensor:
    """All parameters as one float64 vector; with ``deepspeed_master`` DeepSpeed's fp32 master
    copies (its bf16 parameters round away updates smaller than a bf16 unit of the weight)."""
    from deepspeed.utils import safe_get_full_fp32_param

    def value(p: torch.Tensor) -> torch.Tensor:  # a frozen parameter has no master copy
        return safe_get_full_fp32_param(p) if deepspeed_master and p.requires_grad else p.detach()

    return torch.cat([value(p).double().flatten() for p in module.parameters()])


@pytest.mark.slow
def test_deepspeed_bf16_equals_ddp_bf16():
    """Both run the forward in bf16 on the same rounded weights (the cast backbone computes
    what autocast computes, tests/partial_fc/test_backbones.py), so the first losses are
    equal. Then the gradients differ by bf16 rounding (DeepSpeed keeps, averages and clips
    them in bf16, DDP in fp32, both backpropagate through bf16 activations), which compounds
    over the layers and the second step. The yardstick for "agree within bf16 precision":
    DeepSpeed bf16's update is closer to DDP bf16's than DDP bf16's is to the fp32 run's (a
    scaling or dtype bug gives differences of the update's own size)."""
    per_rank = run_ranks(_bf16_engines, 2, timeout=240)
    for rank, res in enumerate(per_rank):
        ddp, ds, fp32 = res["ddp-bf16"], res["deepspeed-bf16"], res["ddp-fp32"]
        assert ds["losses"][0] == pytest.approx(ddp["losses"][0], rel=1e-6), rank
        assert ds["losses"][1] == pytest.approx(ddp["losses"][1], rel=2**-8), rank

        def spread(a: dict, b: dict) -> float:
            return float((a["update"] - b["update"]).norm() / b["update"].norm())

        bf16_vs_fp32, ds_vs_ddp = spread(ddp, fp32), spread(ds, ddp)
        assert ds_vs_ddp < bf16_vs_fp32, (rank, ds_vs_ddp, bf16_vs_fp32)
        _assert_close(ds["rows"], ddp["rows"], (rank, "head rows"), rel=1e-3)


BF16_STEPS = 40


def _head_losses(state_dtype: str, *overrides: str, round_start: bool = False) -> torch.Tensor:
    """Losses of BF16_STEPS engine steps (tiny backbone, 11 classes, batch 12, one rank)."""
    cfg = make_config("train.batch_size=12", f"head.state_dtype={state_dtype}", *overrides)
    engine = build_engine(cfg, total_steps=BF16_STEPS)
    if round_start:
        with torch.no_grad():
            engine.head.weight.copy_(engine.head.weight.bfloat16())
    return torch.tensor([engine.step(s, local_micro_batches(s % 8, 12, 0, 1, 1)).loss
                         for s in range(BF16_STEPS)])


@pytest.mark.parametrize("overrides", [(), ("head.sample_rate=0.5",),
                                       ("head.sample_rate=0.5", "optim.name=adamw",
                                        "optim.lr=0.01")])
def test_bf16_head_state_tracks_the_fp32_run(one_rank_group, overrides):
    """A run with head.state_dtype=bf16 against the fp32 run from the same (rounded) start.

    The yardstick is the run's own sensitivity: ``gap_1``, the largest per-step loss gap
    between two fp32 runs whose initial head weights differ by one bf16 rounding. bf16
    storage makes such a perturbation at every step (the update rounded once, and the
    embeddings rounded for the matmuls); ``BF16_STEPS`` independent perturbations of that
    size add up to about ``sqrt(BF16_STEPS) gap_1`` (6.3x here; measured 1.3-2.9x over
    three seeds of these set-ups). Updates that bf16 lost systematically, or a wrong
    rounding or scale, give gaps of the loss's own size (it falls ~100x over the run)."""
    fp32 = _head_losses("fp32", *overrides)
    start = _head_losses("fp32", *overrides, round_start=True)
    bf16 = _head_losses("bf16", *overrides)
    gap_1 = float((fp32 - start).abs().max())
    gap = float((bf16 - start).abs().max())
    assert 0 < gap <= math.sqrt(BF16_STEPS) * gap_1 + 1e-3, (gap, gap_1)
    assert bf16[-10:].mean() < 0.05 * bf16[0]  # it learns (12.6-12.9 -> 0.03-0.12)


@pytest.mark.parametrize(("precision", "operands"), [("bf16", torch.bfloat16),
                                                     ("fp32", None)])
def test_the_head_gets_bf16_operands_in_a_bf16_run(one_rank_group, precision, operands):
    """A bf16 run calls the head under bf16 autocast (bf16 matmul operands; the head keeps its
    softmax in fp32, tests/partial_fc/test_head.py), an fp32 run without: what the Triton
    kernels' speed on a GPU depends on. The embeddings it receives are fp32 either way."""
    engine = build_engine(make_config(f"engine.precision={precision}", "train.batch_size=12"))
    seen, forward = [], engine.head.forward

    def spy(e, *args, **kwargs):
        autocast = torch.is_autocast_enabled("cpu")
        seen.append((e.dtype, torch.get_autocast_dtype("cpu") if autocast else None))
        return forward(e, *args, **kwargs)

    engine.head.forward = spy
    engine.step(0, local_micro_batches(0, 12, 0, 1, 1))
    assert seen == [(torch.float32, operands)]


def _compiled_and_eager(rank: int, world: int, root: str) -> dict:
    """Two steps with ``engine.compile`` off and on (same init and batches), then each engine
    resumes from the other's checkpoint and takes a third step."""
    from trainer import checkpoint
    batches = [local_micro_batches(s, GLOBAL_BATCH, rank, world, 1) for s in range(3)]
    engines, out = {}, {}
    for compiled in (False, True):
        cfg = make_config(f"engine.compile={str(compiled).lower()}", "train.clip_grad_norm=0.05",
                          f"train.batch_size={GLOBAL_BATCH // world}")
        engine = engines[compiled] = build_engine(cfg, backbone=tiny_batchnorm_backbone)
        losses = [engine.step(s, batches[s]).loss for s in range(2)]
        out[compiled] = {"losses": losses, **snapshot(engine)}
        saved = checkpoint.save(Path(root) / str(compiled), 2, engine, checkpoint.RunRecord(),
                                keep=1)
        out[compiled]["saved"] = snapshot(engine)  # BatchNorm statistics averaged by the save
        out[compiled]["keys"] = sorted(torch.load(saved / "backbone.pt", weights_only=True))
    for compiled, engine in engines.items():
        checkpoint.load(Path(root) / str(not compiled) / "checkpoints" / "step-00000002", engine)
        out[compiled]["loaded"] = snapshot(engine)
        out[compiled]["third"] = engine.step(2, batches[2]).loss
    return out


@pytest.mark.slow
def test_compiled_backbone_steps_as_eager_and_checkpoints_interchange(tmp_path):
    """``engine.compile``: DDP over ``torch.compile`` of a backbone with BatchNorm on 2 ranks
    (so the compiled graph's running-statistics updates are checked too) against the eager run.
    Inductor fuses and reorders fp32 reductions (BatchNorm statistics, convolution weight
    gradients), the same kind of rounding difference as 2 ranks against 1, so the same
    normwise 1e-4 bound applies (measured: 1e-6 relative on the parameters, 6e-7 on the loss).
    The checkpoints carry the plain backbone's keys (no ``_orig_mod.``), so each setting
    resumes the other's checkpoint bit for bit."""
    per_rank = run_ranks(_compiled_and_eager, 2, args=(str(tmp_path),), timeout=540)
    for rank, res in enumerate(per_rank):
        eager, compiled = res[False], res[True]
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5), rank
        for name, value in eager["backbone"].items():
            _assert_close(compiled["backbone"][name], value, (rank, name))
        _assert_close(compiled["rows"], eager["rows"], (rank, "head rows"))
        assert compiled["keys"] == eager["keys"] == sorted(eager["backbone"])
        assert same_snapshots(eager["loaded"], compiled["saved"])
        assert same_snapshots(compiled["loaded"], eager["saved"])
        assert compiled["third"] == pytest.approx(eager["third"], rel=1e-5), rank


def test_deepspeed_accelerator_follows_the_run_device(monkeypatch):
    """On a GPU machine DeepSpeed picks CUDA; a device=cpu run must get the CPU accelerator."""
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    from trainer.engine.deepspeed_backend import import_deepspeed

    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    before = get_accelerator()
    set_accelerator(CUDA_Accelerator())  # what DeepSpeed chose on a machine with a GPU
    try:
        import_deepspeed(torch.device("cpu"))
        assert get_accelerator().device_name() == "cpu"
        assert os.environ["DS_ACCELERATOR"] == "cpu"
    finally:
        set_accelerator(before)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_flip_bits_mirror_on_the_device_as_the_loader_would(one_rank_group, grad_accum):
    """Micro-batches ``(images, labels, flips)`` from a loader that defers its flip step
    exactly as the same images mirrored by the loader: losses and every state bit-equal."""
    def run(with_bits: bool) -> tuple[list, dict]:
        cfg = make_config(f"train.grad_accum={grad_accum}",
                          f"train.batch_size={GLOBAL_BATCH // grad_accum}")
        engine, losses = build_engine(cfg), []
        for step in range(2):
            batches = local_micro_batches(step, GLOBAL_BATCH, 0, 1, grad_accum)
            flips = [torch.rand(len(y), generator=torch.Generator().manual_seed(step)) < 0.5
                     for _, y in batches]
            batches = ([(x, y, f) for (x, y), f in zip(batches, flips, strict=True)]
                       if with_bits else
                       [(torch.where(f.view(-1, 1, 1, 1), x.flip(-1), x), y)
                        for (x, y), f in zip(batches, flips, strict=True)])
            losses.append(engine.step(step, batches).loss)
        return losses, snapshot(engine)

    (bits_losses, bits), (mirrored_losses, mirrored) = run(True), run(False)
    assert bits_losses == mirrored_losses and same_snapshots(bits, mirrored)
