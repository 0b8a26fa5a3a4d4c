"""Device plumbing of a training step: channels_last backbone and input,
cuDNN autotuning, page-locked batches and the training flip on CUDA; CPU runs exactly as
before.

The CPU tests check that nothing changes there (the switches default to on); the cuda-marked
tests check that the switches take effect and that a channels_last step computes the same
loss and update as an NCHW one (fp32, IEEE matmuls: only the convolution algorithms differ).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from launch_helpers import build_engine, local_micro_batches, make_config, snapshot


def _conv_weight(engine) -> torch.Tensor:
    return next(m.weight for m in engine.backbone.modules() if isinstance(m, torch.nn.Conv2d))


@contextlib.contextmanager
def _one_gpu_rank():
    """GPU 0 as a 1-rank NCCL group for the block."""
    import torch.distributed as dist

    os.environ.setdefault("LOCAL_RANK", "0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _assert_close_updates(got: dict, want: dict) -> None:
    """Two steps' :func:`snapshot` s apart by no more than fp32 convolutions summing in other
    orders (~1e-6 relative)."""
    assert torch.allclose(got["rows"], want["rows"], rtol=1e-4, atol=1e-6)
    for name, value in want["backbone"].items():
        assert torch.allclose(got["backbone"][name], value, rtol=1e-4, atol=1e-6), name


def test_cpu_engine_keeps_nchw_and_leaves_cudnn_alone(one_rank_group):
    cfg = make_config()
    assert cfg.engine.channels_last and cfg.engine.cudnn_benchmark  # the defaults
    benchmark = torch.backends.cudnn.benchmark
    engine = build_engine(cfg)
    weight = _conv_weight(engine)
    assert weight.is_contiguous() and not weight.is_contiguous(memory_format=torch.channels_last)
    assert engine.memory_format == torch.contiguous_format
    assert torch.backends.cudnn.benchmark == benchmark


def test_loader_does_not_pin_by_default(tmp_path):
    from data_pipeline import make_loader, write_synthetic_dataset

    write_synthetic_dataset(tmp_path, num_classes=4, images_per_class=6, seed=0)
    loader = make_loader(tmp_path, batch_size=5, num_workers=0)
    images, labels = next(iter(loader))
    assert images.shape == (5, 3, 112, 112) and not images.is_pinned()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("workers", [0, 1])
def test_loader_pins_batches_on_cuda(tmp_path, workers):
    """Pinned batches with the flip deferred, mirrored on the GPU as the engine does, equal
    the batches the workers mirror themselves."""
    from data_pipeline import make_loader, write_synthetic_dataset
    from partial_fc.backbones import normalize_images

    write_synthetic_dataset(tmp_path, num_classes=4, images_per_class=6, seed=0)
    plain = list(make_loader(tmp_path, batch_size=5, num_workers=workers))
    pinned = list(make_loader(tmp_path, batch_size=5, num_workers=workers, pin_memory=True,
                              flip="deferred"))
    assert all(t.is_pinned() for batch in pinned for t in batch), workers
    for (x, y), (xp, yp, flips) in zip(plain, pinned, strict=True):
        on_gpu = normalize_images(xp.cuda(non_blocking=True), flips.cuda(non_blocking=True))
        # Both normalised on the GPU: its division by 127.5 is a multiplication by the
        # reciprocal, one ulp off the CPU's now and then (the first GPU run, 2026-11-27).
        assert torch.equal(on_gpu, normalize_images(x.cuda())) and torch.equal(y, yp), workers


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_channels_last_step_equals_nchw_step_on_cuda():
    matmul = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    out = {}
    try:
        with _one_gpu_rank():
            for channels_last in (True, False):
                cfg = make_config("train.batch_size=8", f"engine.channels_last={channels_last}")
                engine = build_engine(cfg, device="cuda:0")
                fmt = torch.channels_last if channels_last else torch.contiguous_format
                assert _conv_weight(engine).is_contiguous(memory_format=fmt), channels_last
                loss = engine.step(0, local_micro_batches(0, 8, 0, 1, 1)).loss
                out[channels_last] = loss, snapshot(engine)
        assert torch.backends.cudnn.benchmark
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul
        torch.backends.cudnn.benchmark = benchmark
    (loss_cl, snap_cl), (loss_nchw, snap_nchw) = out[True], out[False]
    # fp32 with TF32 off: different conv algorithms sum in other orders (~1e-6 relative).
    assert loss_cl == pytest.approx(loss_nchw, rel=1e-5)
    _assert_close_updates(snap_cl, snap_nchw)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefetched_steps_equal_steps_copied_on_their_own_stream_on_cuda():
    """``engine.prefetch`` on a GPU: three steps on pinned batches copied on the side stream
    (``trainer.engine.prefetch``) equal three steps copied by the step itself; a copy the
    step read before it landed, or memory handed back too early, would differ by far more
    than the convolutions' summation order."""
    out = {}
    with _one_gpu_rank():
        for prefetch in (True, False):
            engine = build_engine(make_config("train.batch_size=8", "engine.cudnn_benchmark=false",
                                              f"engine.prefetch={prefetch}"), device="cuda:0")
            groups = [[tuple(t.pin_memory() for t in local_micro_batches(i, 8, 0, 1, 1)[0])]
                      for i in range(3)]
            losses = [engine.step(i, group).loss
                      for i, group in enumerate(engine.prefetch(iter(groups)))]
            out[prefetch] = losses, snapshot(engine)
    (got, snap), (want, ref) = out[True], out[False]
    assert got == pytest.approx(want, rel=1e-5)
    _assert_close_updates(snap, ref)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_step_statistics_forward_puts_the_cuda_random_stream_back_on_cuda():
    """``train.global_batch``'s forward without grad (``step_embeddings``) on the GPU: its
    dropout draws from the CUDA stream, which is as it was afterwards, and so are the
    BatchNorm statistics; its embeddings are fp32 in the micro-batches' order."""
    from types import SimpleNamespace

    from trainer.engine.step_statistics import step_embeddings

    device = torch.device("cuda", 0)
    backbone = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(4)).to(device)
    batches = [(torch.randn(3, 4, device=device), torch.zeros(3, device=device))
               for _ in range(2)]
    rng, stats = torch.cuda.get_rng_state(device), backbone[1].running_mean.clone()
    out = step_embeddings(backbone, batches, backbone.train(), SimpleNamespace(step=7), device)
    assert out.shape == (6, 4) and out.dtype == torch.float32 and out.device == device
    assert torch.equal(torch.cuda.get_rng_state(device), rng)
    assert torch.equal(backbone[1].running_mean, stats)
