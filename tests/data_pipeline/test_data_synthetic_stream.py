"""data_pipeline.synthetic_stream: the hash and the permutation, determinism, the rank split,
resume, learnability; data.source=synthetic through the config and launch.train; the
scale demo (bench/scale_demo.py, make demo-scale) at a toy size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from launch_helpers import ROOT

from data_pipeline import SyntheticStream
from data_pipeline.synthetic_stream import MASK32, _bicubic_rows, _i32, mix32, permute, render
from trainer.config import ConfigError, load_config


def _epoch(stream: SyntheticStream) -> list[tuple]:
    return list(stream)


def test_mix32_is_the_uint32_hash_on_python_integers():
    """The int32 arithmetic (wrapping products, masked shifts) equals the uint32 hash."""

    def reference(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & MASK32
        x ^= x >> 15
        x = (x * 0x5BD1E995) & MASK32
        return x ^ (x >> 16)

    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 123456789, 0xDEADBEEF, 0x80000001]
    got = mix32(torch.tensor([_i32(v) for v in values], dtype=torch.int32))
    assert [g & MASK32 for g in got.tolist()] == [reference(v) for v in values]


@pytest.mark.parametrize("total", [1, 2, 3, 7, 16, 17, 1000, 4099])
def test_permute_is_a_seeded_bijection(total):
    positions = torch.arange(total)
    order = permute(positions, total, seed=3, epoch=1)
    assert sorted(order.tolist()) == list(range(total))
    assert torch.equal(order, permute(positions, total, seed=3, epoch=1))
    if total >= 16:
        assert not torch.equal(order, permute(positions, total, seed=3, epoch=2))
        assert not torch.equal(order, permute(positions, total, seed=4, epoch=1))


def test_canvas_rows_are_bicubic_interpolation():
    """Two small matmuls give F.interpolate(bicubic) of the 4x4 grid, cropped."""
    grid = torch.rand(2, 3, 4, 4) * 255
    rows = _bicubic_rows(torch.device("cpu"))
    full = F.interpolate(grid, size=(128, 128), mode="bicubic", align_corners=False)
    torch.testing.assert_close(rows @ grid @ rows.T, full, atol=1e-3, rtol=1e-5)


def test_images_are_a_function_of_seed_label_and_image():
    labels, images = torch.tensor([3, 3, 5]), torch.tensor([0, 1, 0])
    a = render(labels, images, seed=0)
    assert a.shape == (3, 3, 112, 112) and a.dtype == torch.uint8
    assert torch.equal(a, render(labels, images, seed=0))
    assert not torch.equal(a, render(labels, images, seed=1))
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    flipped = render(labels, images, seed=0, flip=torch.tensor([True, False, False]))
    assert torch.equal(flipped[0], a[0].flip(-1)) and torch.equal(flipped[1:], a[1:])


def test_same_class_images_are_more_alike_than_other_classes():
    """Learnable: mean pixel distance within an identity well below that between them."""
    classes, per = 12, 4
    labels = torch.arange(classes).repeat_interleave(per)
    x = render(labels, torch.arange(per).repeat(classes), seed=0).float().flatten(1)
    dist = torch.cdist(x, x)
    same = labels[:, None] == labels[None, :]
    off_diagonal = ~torch.eye(len(labels), dtype=torch.bool)
    within, between = dist[same & off_diagonal].mean(), dist[~same].mean()
    assert within < 0.6 * between, (within, between)


def test_same_seed_same_batches_epochs_differ():
    kwargs = {"batch_size": 4, "seed": 7}
    a, b = SyntheticStream(10, 3, **kwargs), SyntheticStream(10, 3, **kwargs)
    for (xa, ya), (xb, yb) in zip(_epoch(a), _epoch(b), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.shape == (4, 3, 112, 112) and xa.dtype == torch.uint8
        assert ya.dtype == torch.int64 and 0 <= int(ya.min()) and int(ya.max()) < 10
    first = torch.cat([y for _, y in _epoch(a)])
    a.set_epoch(1)
    assert not torch.equal(first, torch.cat([y for _, y in _epoch(a)]))
    other = SyntheticStream(10, 3, batch_size=4, seed=8)
    assert not torch.equal(first, torch.cat([y for _, y in _epoch(other)]))


def test_ranks_split_the_epoch_disjointly_up_to_the_drop():
    """21 samples, 3 ranks x batch 2: 3 equal batches each, 18 distinct samples, 3 dropped."""
    ranks = [SyntheticStream(7, 3, batch_size=2, rank=r, world_size=3, seed=1, with_keys=True)
             for r in range(3)]
    keys = []
    for stream in ranks:
        batches = _epoch(stream)
        assert len(stream) == len(batches) == 3
        assert stream.dropped_fraction == pytest.approx(3 / 21)
        for _, labels, batch_keys in batches:
            assert labels.tolist() == [int(k.split("/")[0]) for k in batch_keys]
            keys += batch_keys
    assert len(keys) == len(set(keys)) == 18
    assert set(keys) <= {f"{c}/{i}" for c in range(7) for i in range(3)}
    # With no drop, the ranks cover the epoch exactly once.
    full = [SyntheticStream(6, 2, batch_size=2, rank=r, world_size=2, with_keys=True)
            for r in range(2)]
    covered = sorted(k for s in full for _, _, ks in _epoch(s) for k in ks)
    assert covered == sorted(f"{c}/{i}" for c in range(6) for i in range(2))
    assert full[0].dropped_fraction == 0.0


def test_resume_mid_epoch_continues_the_same_batches():
    kwargs = {"batch_size": 4, "seed": 2, "epoch": 1}
    whole = _epoch(SyntheticStream(9, 4, **kwargs))
    first = SyntheticStream(9, 4, **kwargs)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))  # as checkpoints store it
    second = SyntheticStream(9, 4, batch_size=4, seed=2)
    second.load_state_dict(state)
    second.set_epoch(1)  # the trainer does this: the current epoch keeps the position
    assert second.batches_done == 3
    rest = _epoch(second)
    assert len(rest) == len(whole) - 3
    for (xa, ya), (xb, yb) in zip(whole[3:], rest, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert second.batches_done == len(second)
    assert len(_epoch(second)) == len(whole)  # a finished epoch iterates again


def test_resume_on_another_rank_split_of_the_same_global_batch():
    """2 ranks x 4 saved, 1 rank x 8 resumed: the same remaining samples, none repeated."""
    two = [SyntheticStream(10, 4, batch_size=4, rank=r, world_size=2, with_keys=True)
           for r in range(2)]
    seen = []
    for stream in two:
        it = iter(stream)
        seen += [k for _ in range(2) for k in next(it)[2]]
    one = SyntheticStream(10, 4, batch_size=8, with_keys=True)
    one.load_state_dict(two[1].state_dict())
    rest = [k for _, _, ks in _epoch(one) for k in ks]
    assert one.batches_done == len(one) == 5 and len(rest) == 24
    assert len(set(seen) | set(rest)) == 40


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="rank=2"):
        SyntheticStream(5, 2, batch_size=2, rank=2, world_size=2)
    from data_pipeline.errors import DataError

    with pytest.raises(DataError, match="cannot fill one batch"):
        SyntheticStream(5, 2, batch_size=4, world_size=3)


def _load(*overrides: str):
    return load_config(ROOT / "configs" / "smoke.yaml", list(overrides), resolve=True)


def test_config_fills_the_synthetic_sizes_without_a_folder(tmp_path):
    cfg = _load("data.source=synthetic", "data.num_classes=1000000", f"output={tmp_path}/r",
                "data.dir=/nonexistent", "log.wandb=disabled")
    assert (cfg.data.num_classes, cfg.data.num_samples) == (1_000_000, 4_000_000)


@pytest.mark.parametrize("overrides,line", [
    (["data.source=synthetic"], "data.num_classes: required with data.source=synthetic"),
    (["data.source=synthetic", "data.num_classes=10", "data.num_samples=7"],
     "command line: data.num_samples=7: data.source=synthetic makes num_classes x "
     "synthetic_images_per_class = 40"),
    (["data.synthetic_images_per_class=3"],
     "command line: data.synthetic_images_per_class=3: only read with data.source=synthetic"),
    (["data.source=synthetic", "data.num_classes=2", "data.synthetic_images_per_class=3"],
     "the 6 samples in the synthetic data cannot fill one step"),
    (["data.source=tfrecord"], "command line: data.source='tfrecord': Input should be"),
])
def test_bad_synthetic_config_is_one_line(tmp_path, overrides, line):
    with pytest.raises(ConfigError) as err:
        _load(*overrides, f"output={tmp_path}/r", "log.wandb=disabled")
    assert any(line in msg for msg in str(err.value).splitlines()), str(err.value)


@pytest.mark.slow
def test_train_on_the_synthetic_stream_loss_falls(tmp_path, capsys):
    """launch.train, one process, no data folder: the loss of 20 steps falls."""
    from launch.train import main

    run = tmp_path / "run"
    code = main(["--config", str(ROOT / "configs" / "smoke.yaml"), "data.source=synthetic",
                 "data.num_classes=8", "data.synthetic_images_per_class=4", f"output={run}",
                 "engine.type=ddp", "train.batch_size=8", "train.max_steps=20", "train.epochs=9",
                 "log.every=1",
                 "log.progress=false", "log.wandb=disabled", "log.hist_every=0",
                 "backbone.embedding_size=32"])
    assert code == 0, capsys.readouterr().err
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses


def test_make_demo_scale_passes_its_variables():
    # --no-print-directory: under `make test` MAKELEVEL makes make announce its directory.
    out = subprocess.run(["make", "-n", "--no-print-directory", "demo-scale", "SETUP=",
                          "PY=python3", "CLASSES=7", "STEPS=9",
                          "BATCH=5", "BACKBONE=iresnet18", "DEVICE=cpu", "DEMO_PNG=/p",
                          "ARGS=--jobs 2 optim.lr=0.2"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    cmd = " ".join(out.stdout.replace("\\\n", " ").split())
    assert cmd == ("python3 bench/scale_demo.py --png /p --classes 7 --steps 9 --batch 5 "
                   "--backbone iresnet18 --device cpu --jobs 2 optim.lr=0.2"), cmd


@pytest.mark.slow
@pytest.mark.long
def test_make_demo_scale_at_a_toy_size(tmp_path):
    """`make demo-scale` end to end on CPU: four short runs, then the report's PNGs."""
    png = tmp_path / "png"
    args = (f"--work {tmp_path / 'runs'} --jobs 2 backbone.embedding_size=32 log.every=1 "
            "log.hist_every=2")
    cmd = ["make", "-s", "demo-scale", "SETUP=", f"PY={sys.executable}", "CLASSES=50", "STEPS=3",
           "BATCH=8", "BACKBONE=iresnet_tiny", "DEVICE=cpu", f"DEMO_PNG={png}", f"ARGS={args}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "scale demo: 4 runs" in out.stdout
    for name in ("scale", "theta_med", "b_avg", "angles", "loss"):
        assert (png / f"{name}.png").stat().st_size > 1000
    for run in ("arcface_r0.1", "adacos_fixed_r0.1", "adacos_dynamic_r0.1", "adacos_dynamic_r1"):
        config = (tmp_path / "runs" / run / "config.yaml").read_text()
        assert "source: synthetic" in config and "num_classes: 50" in config


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stream_equals_the_cpu_stream():
    """Generated on the GPU: the same labels, the same images up to one grey level (the
    canvas matmuls may round differently there, e.g. TF32)."""
    kwargs = {"batch_size": 16, "rank": 1, "world_size": 2, "seed": 5}
    cpu, gpu = SyntheticStream(50, 4, **kwargs), SyntheticStream(50, 4, device="cuda", **kwargs)
    for (xc, yc), (xg, yg) in zip(_epoch(cpu), _epoch(gpu), strict=True):
        assert xg.is_cuda and yg.is_cuda and torch.equal(yc, yg.cpu())
        assert (xc.int() - xg.cpu().int()).abs().max() <= 1
