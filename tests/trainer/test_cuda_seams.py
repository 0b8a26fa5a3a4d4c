"""The CUDA-only branches of the trainer, the loaders and the head, reached on CPU.

Each test fakes the one device call its branch makes (``torch.cuda.is_available``, the CUDA
RNG get/set pair, ``Tensor.pin_memory``, a copy to a CUDA device, ``torch.compile``...) and
checks what the branch does with the answer; the real call runs in the cuda-marked test that
docs/gpu.md's inventory names next to it. A faked seam proves the branch is taken and wired
right, not that the GPU computes the same numbers: that is the GPU test's part.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from launch_helpers import build_engine, local_micro_batches, make_config

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def gpu_visible(monkeypatch):
    """torch says a GPU is there (nothing else about CUDA is faked)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture
def fake_cuda_copies(monkeypatch):
    """``Tensor.pin_memory`` returns a copy it remembers (CPU has no page-locked allocator) and
    ``Tensor.to(<cuda device>, ...)`` stays on the CPU, recording its keyword arguments."""
    record = SimpleNamespace(pinned=[], copies=[])
    real_to = torch.Tensor.to

    def pin_memory(self, *args, **kwargs):
        out = self.clone()
        record.pinned.append(out)
        return out

    def to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, (torch.device, str)) and torch.device(target).type == "cuda":
            record.copies.append((self, kwargs))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return record


def test_a_gpu_rank_gets_the_gpu_of_its_local_rank(monkeypatch):
    from trainer.dist import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", 3) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto", 3) == torch.device("cuda", 3)
    assert resolve_device("cuda", 1) == torch.device("cuda", 1)
    assert resolve_device("cpu", 1) == torch.device("cpu")


def test_a_gpu_rank_sets_its_device_and_asks_for_nccl(monkeypatch, gpu_visible):
    """The group is started with gloo in place of the NCCL it asked for (CPU has no NCCL)."""
    from trainer.dist import init_distributed, shutdown

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    set_to, asked = [], []
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    real_init = dist.init_process_group

    def init(backend, *, store, rank, world_size, timeout, **options):
        asked.append((backend, options))
        real_init("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)

    monkeypatch.setattr(dist, "init_process_group", init)
    try:
        env = init_distributed("auto")
    finally:
        shutdown()
    assert env.device == CUDA0 and set_to == [CUDA0]
    assert [backend for backend, _ in asked] == ["nccl"]


def test_peak_memory_comes_from_the_cuda_allocator_on_cuda(monkeypatch):
    from trainer.telemetry.logger import memory_mb

    asked = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device: asked.append(device) or 3 * 2**20)
    assert memory_mb(CUDA0) == 3.0 and asked == [CUDA0]
    assert memory_mb(torch.device("cpu")) > 0 and asked == [CUDA0]  # max RSS on CPU


def test_checkpoint_puts_the_cuda_generator_back_where_it_was_saved(tmp_path, one_rank_group,
                                                                   monkeypatch):
    """A CUDA run's checkpoint holds the CUDA generator (dropout's draws), and loading it puts
    the generator back to its state at the save after later draws moved it; a CPU engine
    loading the same checkpoint leaves the generator alone. The generator is a stateful fake
    (get, set, a draw that advances it); ``test_checkpoint.py::test_cuda_rng_is_saved_and_restored``
    runs the real one on a GPU."""
    from trainer import checkpoint

    state = {"cuda:0": torch.arange(16, dtype=torch.uint8)}  # GPU 0's generator

    def get_rng_state(device):
        return state[str(torch.device(device))].clone()  # KeyError off GPU 0, as torch raises

    def set_rng_state(new, device):
        get_rng_state(device)
        state[str(torch.device(device))] = new.clone()

    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    engine = build_engine(make_config("train.batch_size=4"))
    engine.device = CUDA0  # as a CUDA run's engine; only the RNG bookkeeping reads it here
    path = checkpoint.save(tmp_path, 1, engine, checkpoint.RunRecord(), keep=1)
    saved = state["cuda:0"].clone()
    state["cuda:0"] += 1  # draws after the save
    engine.device = torch.device("cpu")
    checkpoint.load(path, engine)
    assert torch.equal(state["cuda:0"], saved + 1)  # a CPU engine does not touch it
    engine.device = CUDA0
    checkpoint.load(path, engine)
    assert torch.equal(state["cuda:0"], saved)


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("autotune", [True, False])
def test_cuda_engine_takes_channels_last_and_cudnn_autotuning_from_the_config(
        monkeypatch, channels_last, autotune):
    """(The parameter is not called ``benchmark``: pytest-benchmark, installed on the GPU
    machine, owns that fixture name and aborts the run.)"""
    from trainer.engine import Engine

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", not autotune)
    cfg = make_config(f"engine.channels_last={channels_last}",
                      f"engine.cudnn_benchmark={autotune}")
    fmt = Engine._cuda_settings(SimpleNamespace(device=CUDA0, cfg=cfg))
    assert fmt == (torch.channels_last if channels_last else torch.contiguous_format)
    assert torch.backends.cudnn.benchmark is autotune


def test_engine_copies_the_batch_to_its_device_without_waiting(one_rank_group, monkeypatch):
    """``non_blocking=True`` on the images, the labels and the flip bits: from pinned memory
    the copy to a GPU is asynchronous (on CPU the flag changes nothing, so only the call is
    checked)."""
    engine = build_engine(make_config("train.batch_size=4"))
    images, labels = local_micro_batches(0, 4, 0, 1, 1)[0]
    flips = torch.tensor([True, False, False, True])
    batch, seen = (images, labels, flips), []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if any(self is t for t in batch) and args and isinstance(args[0], torch.device):
            which = next(i for i, t in enumerate(batch) if self is t)
            seen.append((which, args, kwargs.get("non_blocking")))  # a device copy
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    engine.step(0, [batch])
    assert sorted(seen) == [(i, (engine.device,), True) for i in range(3)]


def test_deepspeed_accelerator_follows_a_cuda_run(monkeypatch):
    """The other direction of test_engine.py's CPU case: a process whose DeepSpeed picked the
    CPU accelerator gets CUDA's for a device=cuda run."""
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from trainer.engine.deepspeed_backend import import_deepspeed

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    before = get_accelerator()
    set_accelerator(CPU_Accelerator())
    try:
        import_deepspeed(CUDA0)
        assert get_accelerator().device_name() == "cuda"
        assert os.environ["DS_ACCELERATOR"] == "cuda"
    finally:
        set_accelerator(before)


@pytest.mark.parametrize("device, pinned", [(CUDA0, True), (torch.device("cpu"), False)])
def test_trainer_asks_for_pinned_batches_on_cuda_only(synthetic_data, device, pinned):
    from trainer.build import build_loader
    from trainer.dist import DistEnv

    cfg = make_config(f"data.dir={synthetic_data}", "data.num_workers=0")
    assert build_loader(cfg, DistEnv(0, 1, 0, device)).pin_memory is pinned


@pytest.mark.parametrize(("flip", "expected"), [("true", "deferred"), ("false", False)])
@pytest.mark.parametrize("folders", [1, 2])
def test_trainer_leaves_the_flip_to_its_engine(synthetic_data, flip, expected, folders):
    """The trainer's shard loaders (one folder or a mixture) hand the flip bits to the
    engine, which mirrors on the run's device (``test_engine.py`` checks the step)."""
    from trainer.build import build_loader
    from trainer.dist import DistEnv

    data = (f"data.dir={synthetic_data}" if folders == 1 else
            f"data.dirs=[{synthetic_data},{synthetic_data}]")
    cfg = make_config(data, f"data.flip={flip}", "data.num_workers=0")
    loader = build_loader(cfg, DistEnv(0, 1, 0, torch.device("cpu")))
    for source in getattr(loader, "sets", [loader]):
        assert source.flip == expected
    assert len(next(iter(loader))) == (3 if expected else 2)


def test_loader_pins_its_batches_when_asked(monkeypatch, fake_cuda_copies, synthetic_data):
    """With an accelerator (faked), the loader pins each decoded chunk (images, labels and
    the deferred flip bits), and a batch cut across two chunks (after corrupt samples) is
    assembled in page-locked memory; the batches equal the unpinned ones
    (``test_device_plumbing.py`` pins for real on CUDA)."""
    from data_pipeline import make_loader
    from data_pipeline.epoch_batches import concat

    options = {"batch_size": 6, "num_workers": 0, "shuffle": False, "flip": "deferred"}
    plain = list(make_loader(synthetic_data, **options))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: CUDA0)
    loader = make_loader(synthetic_data, pin_memory=True, **options)
    pinned = list(loader)
    kinds = [t.dtype for t in fake_cuda_copies.pinned]
    assert min(kinds.count(d) for d in (torch.uint8, torch.int64, torch.bool)) >= len(pinned), \
        "the loader did not pin every chunk's images, labels and flip bits"
    assert len(pinned) == len(plain)
    for want, got in zip(plain, pinned, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    empty, asked = torch.empty, []

    def fake_empty(*args, pin_memory=None, **kwargs):
        asked.append(pin_memory)
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", fake_empty)
    x = plain[0][0]
    assert torch.equal(concat([x[:2], x[2:]], loader.pin_memory), x) and asked == [True]


def test_mixed_loader_pins_its_batches_when_asked(monkeypatch, fake_cuda_copies,
                                                   synthetic_data):
    """``data.dirs`` with an accelerator (faked): the folders' chunks are pinned and the
    mixed batch is assembled in page-locked memory; the batches equal the unpinned ones."""
    from data_pipeline.mixture import make_mixed_loader

    kwargs = {"batch_size": 6, "num_workers": 0, "weights": [2, 1]}
    plain = list(make_mixed_loader([synthetic_data, synthetic_data], **kwargs))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: CUDA0)
    empty, asked = torch.empty, []

    def fake_empty(*args, pin_memory=None, **kw):
        asked.append(pin_memory)
        return empty(*args, **kw)

    monkeypatch.setattr(torch, "empty", fake_empty)
    pinned = list(make_mixed_loader([synthetic_data, synthetic_data], pin_memory=True, **kwargs))
    assert len(pinned) == len(plain) and asked.count(True) >= 2 * len(pinned)  # images, labels
    assert len(fake_cuda_copies.pinned) >= 2 * len(pinned)  # both folders' chunks
    for (x, y), (xp, yp) in zip(plain, pinned, strict=True):
        assert torch.equal(x, xp) and torch.equal(y, yp)


def test_one_merged_folder_pins_its_labels_when_asked(monkeypatch, fake_cuda_copies,
                                                     synthetic_data):
    """``data.dirs=[DIR]`` with ``data.merge`` (a set's duplicate identities, faked
    accelerator): one folder's batch is its loader's own, so the merged labels are pinned
    where they are made; they equal the unpinned ones, paired classes one label."""
    from data_pipeline.merge import MergeList, merged_labels
    from data_pipeline.mixture import make_mixed_loader

    merge = MergeList((str(synthetic_data),), (((0, 3), (0, 7)),))
    kwargs = {"batch_size": 8, "num_workers": 0, "merge": merge}
    plain = list(make_mixed_loader([synthetic_data], **kwargs))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: CUDA0)
    pinned = list(make_mixed_loader([synthetic_data], pin_memory=True, **kwargs))
    labels = [y for _, y in pinned]
    assert all(any(y is p for p in fake_cuda_copies.pinned) for y in labels)
    assert all(torch.equal(y, yp) for (_, y), yp in zip(plain, labels, strict=True))
    people = torch.from_numpy(merged_labels(merge, [20]))  # 20 classes, 19 people
    assert people[3] == people[7] and len(set(people.tolist())) == 19
    unmerged = make_mixed_loader([synthetic_data], batch_size=8, num_workers=0)
    assert all(torch.equal(people[y], yp) for (_, y), yp in zip(unmerged, labels, strict=True))


def test_synthetic_stream_on_cuda_copies_pinned_indices_without_waiting(fake_cuda_copies):
    """The CUDA stream pins the sample indices and copies them with ``non_blocking``; its
    batches are the CPU stream's (``test_data_synthetic_stream.py`` renders on a real GPU)."""
    from data_pipeline import SyntheticStream

    kwargs = {"batch_size": 8, "rank": 1, "world_size": 2, "seed": 3}
    cpu, cuda = SyntheticStream(20, 4, **kwargs), SyntheticStream(20, 4, **kwargs)
    cuda.device = CUDA0  # after __init__ only batch()'s copy reads it
    for (x, y), (xc, yc) in zip(cpu, cuda, strict=True):
        assert torch.equal(x, xc) and torch.equal(y, yc)
    assert len(fake_cuda_copies.copies) == len(cpu) == len(fake_cuda_copies.pinned)
    for (tensor, kwargs), pinned in zip(fake_cuda_copies.copies, fake_cuda_copies.pinned,
                                        strict=True):
        assert tensor is pinned and kwargs == {"non_blocking": True}


def test_head_picks_the_triton_tiles_on_cuda(monkeypatch):
    from partial_fc import PartialFC, build_margin, tiles

    pytest.importorskip("triton")
    from partial_fc.tiles import autotune

    monkeypatch.setattr(tiles, "triton_available", lambda: True)
    pfc = PartialFC(8, 10, build_margin({"type": "arcface"}), kernel="auto",
                    max_tile_bytes=1 << 12)
    assert pfc.tiles.for_device(CUDA0) is autotune.TUNED
    assert pfc.tiles.for_device(torch.device("cpu")) == tiles.ReferenceTiles(1 << 12)
    monkeypatch.setattr(tiles, "triton_available", lambda: False)
    assert pfc.tiles.for_device(CUDA0) == tiles.ReferenceTiles(1 << 12)


def test_evaluate_runs_on_the_gpu_when_one_is_there(monkeypatch, gpu_visible, capsys, tmp_path):
    import launch.evaluate as evaluate

    monkeypatch.chdir(tmp_path)
    (tmp_path / "lfw.bin").write_bytes(b"")  # launch.evaluate checks that it exists
    placed, used = [], []
    backbone = SimpleNamespace(to=placed.append)
    monkeypatch.setattr(evaluate, "load_backbone_or_exit", lambda path: backbone)
    monkeypatch.setattr(evaluate, "evaluate_bins",
                        lambda model, bins, batch, device: used.append(device) or {})
    assert evaluate.main(["--checkpoint", "run", "--bin", "lfw.bin"]) == 0
    assert placed == used == [torch.device("cuda")]
    assert evaluate.main(["--checkpoint", "run", "--bin", "lfw.bin", "--device", "cpu"]) == 0
    assert used[-1] == torch.device("cpu")


@pytest.mark.parametrize("engine_type", ["ddp", "deepspeed"])
def test_channels_last_reaches_the_parameters_only_where_the_backend_keeps_them(
        one_rank_group, monkeypatch, engine_type):
    """On a GPU the input is channels_last; DDP holds the convolution weights channels_last
    too, DeepSpeed contiguous: its start-up broadcast views each parameter as bytes, which a
    channels_last weight refuses (the first GPU run's crash at step 1 of every DeepSpeed
    recipe). ``_cuda_settings`` is faked to answer as on CUDA; only the engine is built, no
    step (the CPU's channels_last convolution backward is not to be trusted, engine.py)."""
    from trainer.engine import Engine

    monkeypatch.setattr(Engine, "_cuda_settings", lambda self: torch.channels_last)
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed insists; torchrun sets it
    engine = build_engine(make_config(f"engine.type={engine_type}"))
    assert engine.memory_format == torch.channels_last
    weights = [p for p in engine.backbone.parameters() if p.dim() == 4]
    assert weights
    held = [p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
            for p in weights]
    assert all(held) if engine_type == "ddp" else not any(held)


def test_stored_teacher_embeddings_reach_the_device_without_waiting(monkeypatch):
    """Offline distillation: the stored (pinned, CPU) teacher embeddings are copied to the
    student's device ``non_blocking``, as fp32 (CPU: only the call can be checked)."""
    from trainer.distill import Distillation

    seen = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        seen.append(kwargs.get("non_blocking"))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    out = Distillation.teacher(SimpleNamespace(), torch.zeros(2, 3), torch.ones(2, 4).half())
    assert out.dtype == torch.float32 and seen == [True]


def test_prefetch_copies_on_a_side_stream_that_the_step_waits_for(monkeypatch):
    """``engine.prefetch`` on CUDA (streams, the copy and ``record_stream`` faked, in one
    log): each group is taken from the loader only once the previous step is handed back
    (so the loader's position in a checkpoint stays the steps'), its tensors are copied
    ``non_blocking`` under the side stream, the step's stream then waits for the side stream,
    and every copy is recorded on the step's stream before the step gets it; a sample key
    passes as it was. ``tests/trainer/test_device_plumbing.py`` runs the real streams."""
    import contextlib

    from trainer.engine.prefetch import Prefetch

    log, made = [], []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait", self.name, other.name))

    step_stream, active = Stream("step"), []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or
                        Stream("side"))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device: active[-1] if active else step_stream)

    @contextlib.contextmanager
    def stream(s):
        active.append(s)
        yield
        active.pop()

    monkeypatch.setattr(torch.cuda, "stream", stream)
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and args[0] == CUDA0:
            log.append(("copy", active[-1].name if active else "step", kwargs["non_blocking"]))
            return self.clone()
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: log.append(("record",
                                                                                 s.name)))
    groups = [[(torch.full((2, 3), float(i)), torch.tensor([i, i])),
               (torch.zeros(1), torch.ones(1), "key")] for i in range(2)]

    def loader():
        for group in groups:
            log.append(("fetch",))
            yield group

    for group, want in zip(Prefetch(CUDA0, enabled=True)(loader()), groups, strict=True):
        log.append(("step",))
        assert all(torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b
                   for got, sent in zip(group, want, strict=True)
                   for a, b in zip(got, sent, strict=True))
    copies = [("copy", "side", True)] * 4
    records = [("record", "step")] * 4
    assert log == 2 * [("fetch",), *copies, ("wait", "step", "side"), *records, ("step",)]
    assert made == [CUDA0]
    log.clear()
    for enabled, device in ((False, CUDA0), (True, torch.device("cpu"))):  # no stream, no copy
        passed = list(Prefetch(device, enabled)(iter(groups)))
        assert all(a is b for a, b in zip(passed, groups, strict=True))
    assert made == [CUDA0] and log == []


@pytest.mark.parametrize("device", [CUDA0, torch.device("cpu")])
def test_step_statistics_forward_puts_the_device_random_stream_back(monkeypatch, device):
    """``train.global_batch``'s forward without grad (``step_embeddings``) forks the random
    stream of a CUDA device as well as the CPU's, so the passes' dropout draws as it would
    without it (``fork_rng`` recorded, then run on the CPU stream alone); on CPU it forks no
    device. Its BatchNorm statistics and the CPU stream are put back either way."""
    from trainer.engine.step_statistics import step_embeddings

    forked, real = [], torch.random.fork_rng

    def fork_rng(devices, **kwargs):
        forked.append(list(devices))
        return real(devices=[], **kwargs)

    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    backbone = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(4)).train()
    batches = [(torch.randn(3, 4), torch.zeros(3)) for _ in range(2)]
    rng, stats = torch.get_rng_state(), backbone[1].running_mean.clone()
    out = step_embeddings(backbone, batches, backbone, SimpleNamespace(step=7), device)
    assert out.shape == (6, 4) and out.dtype == torch.float32
    assert forked == [[CUDA0] if device.type == "cuda" else []]
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(backbone[1].running_mean, stats)
