"""The kernels' launch configurations by device and shape (partial_fc.tiles.tuning, autotune).

Without CUDA the kernels run in triton's interpreter (``TRITON_INTERPRET=1``, set before triton
is imported, as test_tiles.py does) on CPU tensors, which the tuner never tunes; so the device
is faked at the one function that reads it (``tuning.device_info``), and the tuner then runs
its real candidates end to end at a tiny shape (``MIN_WORK`` lowered to reach it). Timings
decide nothing a test checks: the clock is replaced where a test needs a known winner.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from tolerances import rounding_excess

from partial_fc import PartialFC, build_margin
from partial_fc.tiles import ReferenceTiles, tuning
from partial_fc.tiles.selfcheck import normwise

CUDA = torch.cuda.is_available()
if not CUDA:  # must precede the first import of triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
tm = pytest.importorskip("partial_fc.tiles.triton",
                         reason="triton is not installed (pip install triton)")
from partial_fc.tiles import autotune, cublas  # noqa: E402 - after TRITON_INTERPRET

DEVICE = torch.device("cuda" if CUDA else "cpu")
FAKE = tuning.Device("Fake GPU 80GB", sms=2, capability=(9, 0))
N, S, D = 9, 40, 32


def _inputs(e_dtype=torch.float32, w_dtype=torch.float32, n=N, s_cols=S):
    g = torch.Generator().manual_seed(0)
    e = torch.nn.functional.normalize(torch.randn(n, D, generator=g), dim=1)
    w = torch.randn(s_cols, D, generator=g) * 0.05
    w[:n // 2] = e[:n // 2] * 0.07  # cosines of 1: past AdaFace's band, hard, filtered
    tgt = torch.randint(-1, s_cols, (n,), generator=g)
    tgt[:n // 2] = torch.arange(n // 2) + n // 2  # those rows' targets are elsewhere
    inv = 1.0 / w.norm(dim=1)
    return [t.to(DEVICE) for t in (e.to(e_dtype), w.to(w_dtype), inv, tgt)]


@pytest.fixture
def fake_gpu(monkeypatch):
    """The tensors' device reads as a GPU the committed table does not know; tiny shapes
    are tuned, with one timed run per candidate."""
    monkeypatch.setattr(tuning, "device_info", lambda device: FAKE)
    monkeypatch.setattr(autotune, "MIN_WORK", 0)
    monkeypatch.setattr(autotune, "REPEATS", 1)
    tuning.take_notes()  # none left by another test


@pytest.fixture
def measured(monkeypatch):
    """Each call of ``autotune.measure`` as ``(choices, timed)``, passed through."""
    calls, real = [], autotune.measure

    def spy(e, w, device, choices=None, timed=True):
        calls.append((choices, timed))
        return real(e, w, device, choices, timed)

    monkeypatch.setattr(autotune, "measure", spy)
    return calls


def _table(path, choice: tuning.Choice, shape: tuning.Shape):
    path.write_text(json.dumps({"devices": {FAKE.name: {"buckets": {
        shape.key: choice.to_json()}}}}))
    return path


def test_the_shapes_users_run_fall_in_distinct_buckets():
    keys = {tuning.Shape.of(n, int(c * r), 512, torch.bfloat16, w).key
            for n in (512, 1024, 2048) for c in (100_000, 1_000_000, 4_000_000)
            for r in (1.0, 0.1) for w in (torch.float32, torch.bfloat16)}
    assert len(keys) == 3 * 5 * 2  # S: 10k, 100k (twice), 400k, 1M, 4M
    near = tuning.Shape.of(1000, 1_100_000, 512, torch.bfloat16, torch.float32)
    assert near == tuning.Shape.of(1024, 1_000_000, 512, torch.bfloat16, torch.float32)
    assert near.key == "N1024-S1048576-D512-bf16-fp32"


def test_the_default_is_the_kernels_fixed_choice_and_leads_the_candidates():
    assert autotune.as_tiles(tuning.DEFAULT, 132) == tm.cuda_tiles(132)
    for capability in ((8, 0), (9, 0)):
        found = tuning.candidates(capability)
        assert found[0] == tuning.DEFAULT and len(set(found)) == len(found) <= 6
        assert {c.engine for c in found} == set(tuning.ENGINES)
    hopper = set(tuning.candidates((9, 0))) - set(tuning.candidates((8, 0)))
    assert hopper and all(c.rows == c.cols == 128 for c in hopper)  # spilled on sm_80


def test_the_committed_table_holds_valid_choices_only():
    devices = json.loads(tuning.TABLE.read_text())["devices"]
    for device in devices.values():
        for entry in device["buckets"].values():
            tuning.Choice.from_json(entry)
    with pytest.raises(ValueError, match="powers of two"):
        tuning.Choice.from_json({**tuning.DEFAULT.to_json(), "rows": 96})
    with pytest.raises(ValueError, match="expected the fields"):
        tuning.Choice.from_json({"engine": "triton"})


def test_a_device_in_the_table_runs_its_choice_untuned(fake_gpu, measured, monkeypatch,
                                                       tmp_path):
    e, w, inv, tgt = _inputs()
    choice = tuning.candidates(FAKE.capability)[1]
    shape = tuning.Shape.of(N, S, D, e.dtype, w.dtype)
    tuner = autotune.Tuner(_table(tmp_path / "tuned.json", choice, shape))
    monkeypatch.setattr(autotune, "TUNER", tuner)
    got = autotune.TUNED.class_tile_stats(e, w, inv, tgt, 16.0)  # the head's back-end
    assert measured == [([choice], False)]  # checked here, not tuned
    want = ReferenceTiles(1 << 20).class_tile_stats(e, w, inv, tgt, 16.0)
    assert all(normwise(a, b) < 1e-5 for a, b in zip(got, want, strict=True))
    assert tuner.tiles(e, w) == autotune.as_tiles(choice, FAKE.sms)
    (line,) = tuning.take_notes()
    assert line.endswith("(the committed table)") and shape.key in line and FAKE.name in line
    assert not tuning.cache_path().exists()


def test_an_unknown_device_tunes_once_caches_and_says_so(fake_gpu, monkeypatch):
    """Of the real candidates, the cuBLAS engine is made wrong (its matmul off by 1 %) and one
    more fails to compile (a tile of 24 rows): neither may win, however fast; among the rest
    the clock (here: each timing shorter than the last) decides."""
    broken = tuning.Choice("triton", 24, 64, 64, 128, 4, 1, 1)
    offered = [*tuning.candidates(FAKE.capability), broken]
    monkeypatch.setattr(tuning, "candidates", lambda capability: offered)
    real_mm = cublas._mm
    monkeypatch.setattr(cublas, "_mm", lambda a, b: real_mm(a, b) * 1.01)
    clock = iter(range(100, 0, -1))
    monkeypatch.setattr(autotune, "_timed", lambda run, device: float(next(clock)))
    e, w, inv, tgt = _inputs()
    tuner = autotune.Tuner()  # the committed table, which knows no such device
    trials = []
    real_measure = autotune.measure
    monkeypatch.setattr(autotune, "measure", lambda *a: trials.extend(real_measure(*a)) or trials)

    tiles = tuner.tiles(e, w)
    good = [t.choice for t in trials if t.ms is not None]
    dropped = {t.choice: t.error for t in trials if t.ms is None}
    assert set(dropped) == {broken, *(c for c in offered if c.engine == "cublas")}, dropped
    assert all("differs by" in why for c, why in dropped.items() if c.engine == "cublas")
    assert dropped[broken]  # the compiler's complaint
    assert tiles == autotune.as_tiles(good[-1], FAKE.sms)  # the last timed was the fastest
    (line,) = tuning.take_notes()
    assert "tuned now" in line and str(tuning.cache_path()) in line
    shape = tuning.Shape.of(N, S, D, e.dtype, w.dtype)
    assert tuning.cached(FAKE, shape, tuning.cache_path()) == good[-1]

    assert tuner.tiles(e, w) is tiles and tuning.take_notes() == []  # once per process
    checks = []
    monkeypatch.setattr(autotune, "measure", lambda e, w, device, choices=None, timed=True:
                        checks.append((choices, timed)) or real_measure(e, w, device, choices,
                                                                        timed))
    again = autotune.Tuner()  # the next process: the cache answers
    assert again.tiles(e, w) == tiles and checks == [([good[-1]], False)]  # checked, not tuned
    (line,) = tuning.take_notes()
    assert "tuned before" in line


def test_a_tabled_choice_that_fails_here_gives_way_to_the_default(fake_gpu, monkeypatch,
                                                                  tmp_path):
    """A table measured elsewhere (another triton, another torch) whose choice computes a
    wrong answer on this machine: the default runs, and the line says why."""
    e, w, inv, tgt = _inputs()
    engine = next(c for c in tuning.candidates(FAKE.capability) if c.engine == "cublas")
    shape = tuning.Shape.of(N, S, D, e.dtype, w.dtype)
    real_mm = cublas._mm
    monkeypatch.setattr(cublas, "_mm", lambda a, b: real_mm(a, b) * 1.01)
    tuner = autotune.Tuner(_table(tmp_path / "tuned.json", engine, shape))
    assert tuner.tiles(e, w) == autotune.as_tiles(tuning.DEFAULT, FAKE.sms)
    (line,) = tuning.take_notes()
    assert "(the committed table) fails here: differs by" in line and "default" in line


def test_a_head_on_an_unknown_gpu_tunes_at_its_first_step_and_equals_the_torch_head(
        fake_gpu, monkeypatch):
    """Through the head: its first forward (inside autograd, under autocast's off switch
    and the first-use check) tunes, its lines say so once, and loss and gradients are the
    torch path's. Two candidates (one per engine) keep the interpreter's time down."""
    two = [c for c in tuning.candidates(FAKE.capability) if c.num_warps == 4][-2:]
    assert {c.engine for c in two} == set(tuning.ENGINES)
    monkeypatch.setattr(tuning, "candidates", lambda capability: two)
    monkeypatch.setattr(autotune, "TUNER", autotune.Tuner())
    g = torch.Generator().manual_seed(0)
    emb, labels = torch.randn(N, D, generator=g), torch.randint(0, S, (N,), generator=g)
    out = {}
    for kernel in ("torch", "triton"):
        torch.manual_seed(0)
        head = PartialFC(D, S, build_margin(dict(type="arcface", s=16.0)), kernel=kernel)
        x = emb.clone().requires_grad_()
        loss = head(x, labels)
        loss.backward()
        out[kernel] = (loss.detach(), x.grad, head.weight.grad, head.take_notes())
    (line,) = [n for n in out["triton"][3] if "class tiles" in n]
    assert "tuned now" in line and out["torch"][3] == []
    for a, b in zip(out["triton"][:3], out["torch"][:3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def test_the_head_passes_the_tuners_lines_on():
    head = PartialFC(8, 10, build_margin(dict(type="arcface")))
    tuning.note("head: the class tiles on X for Y: Z")
    assert head.take_notes() == ["head: the class tiles on X for Y: Z"]
    assert head.take_notes() == []


@pytest.mark.half
@pytest.mark.parametrize("operands", ["bf16 e, fp32 w", "bf16"])
def test_the_cublas_engine_equals_the_kernels_and_the_reference(operands):
    """Every non-target transform at once (AdaFace's clamp, the inter-class filter,
    CurricularFace's modulation with its hard-negative count), and none; a buffer that
    makes several chunks (forward: two tiles of 16 columns, backward: one) and a part one."""
    from partial_fc.nontarget import NonTarget

    e_dtype, w_dtype = {"bf16": (torch.bfloat16,) * 2,
                        "bf16 e, fp32 w": (torch.bfloat16, torch.float32)}[operands]
    e, w, inv, tgt = _inputs(e_dtype, w_dtype, n=13, s_cols=40)
    engine = tm.Tiles(16, 16, 16, 16, 1, 1, programs=4, buffer_bytes=1664, engine="cublas")
    cublas = autotune.engine(engine)
    for part in (False, True):
        def transform(part: bool = part) -> NonTarget | None:  # a fresh hard-negative count
            return NonTarget(hard_above=torch.full((13,), 0.5, device=DEVICE),
                             t=torch.tensor(0.3), tau=0.9, clamp=1e-3,
                             hard_rows=torch.zeros(13, device=DEVICE)) if part else None
        got, want, ref = transform(), transform(), transform()
        stats = [cublas.class_tile_stats(e, w, inv, tgt, 16.0, nontarget=got, tiles=engine),
                 tm.class_tile_stats(e, w, inv, tgt, 16.0, nontarget=want),
                 ReferenceTiles(4 * 13 * 7).class_tile_stats(e, w, inv, tgt, 16.0, ref)]
        for a, b in zip(stats[0], stats[1], strict=True):
            assert normwise(a, b) < 1e-5
        if not part:  # the head calls the tiles inside autocast: the matmuls must not see it
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                within = cublas.class_tile_stats(e, w.float(), inv, tgt, 16.0, tiles=engine)
            alone = cublas.class_tile_stats(e, w.float(), inv, tgt, 16.0, tiles=engine)
            assert all(torch.equal(a, b) for a, b in zip(within, alone, strict=True))
        assert all(normwise(a, b) < 1e-5 for a, b in zip(stats[0], stats[2], strict=True))
        if part:
            assert torch.equal(got.hard_rows, want.hard_rows) and got.hard_rows.sum() > 0
            assert torch.equal(got.hard_rows, ref.hard_rows)
        row_max, row_sum, _ = stats[2]
        lse = torch.logaddexp(row_max + torch.log(row_sum), torch.zeros_like(row_max))
        coef = torch.full_like(lse, 16.0 / 13)
        back = (lse, coef, torch.where(tgt >= 0, -coef, 0.0))
        grads = [cublas.class_tile_grads(e, w, inv, tgt, 16.0, *back, transform(), tiles=engine),
                 tm.class_tile_grads(e, w, inv, tgt, 16.0, *back, transform()),
                 ReferenceTiles(4 * 13 * 7).class_tile_grads(e, w, inv, tgt, 16.0, *back,
                                                             transform())]
        assert grads[0][1].dtype == w.dtype
        # the same rounded G', summed apart in fp32; a bf16 grad_w then rounded once: one
        # bf16 ulp where the two sums straddle a rounding boundary (seen on AVX-512 BF16)
        for a, b in zip(grads[0], grads[1], strict=True):
            assert rounding_excess(a, b, normwise=1e-5) <= 1
        # G' rounded to bf16 (as the kernels; the reference keeps it fp32): 2**-8 relative
        assert all(normwise(a, b) < 1e-2 for a, b in zip(grads[0], grads[2], strict=True))


def test_the_device_is_read_from_cuda_and_only_there(monkeypatch):
    """``tuning.device_info``, the tuner's one look at the hardware: for a CUDA device the
    name, multiprocessors and capability CUDA reports (``torch.cuda.get_device_properties``
    faked); for any other device None, without asking CUDA."""
    from types import SimpleNamespace

    asked = []
    props = SimpleNamespace(name=FAKE.name, multi_processor_count=FAKE.sms, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: asked.append(device) or props)
    assert tuning.device_info(torch.device("cuda", 1)) == FAKE
    assert tuning.device_info(torch.device("cpu")) is None
    assert asked == [torch.device("cuda", 1)]


def test_a_gpu_timing_is_the_median_of_cuda_events_around_each_run(monkeypatch):
    """``autotune._timed`` on CUDA (``torch.cuda.Event`` faked, in one log with the runs):
    each run between its own two recorded events, the end event waited for before the time
    between them is read, and the median of those times returned."""
    log, events, times = [], [], iter([5.0, 1.0, 3.0])

    class Event:
        def __init__(self, enable_timing: bool):
            assert enable_timing
            self.id = len(events)
            events.append(self)

        def record(self):
            log.append(("record", self.id))

        def synchronize(self):
            log.append(("wait", self.id))

        def elapsed_time(self, end):
            log.append(("read", self.id, end.id))
            return next(times)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(autotune, "REPEATS", 3)
    assert autotune._timed(lambda: log.append(("run",)), torch.device("cuda", 0)) == 3.0
    assert log == [entry for i in (0, 2, 4) for entry in (
        ("record", i), ("run",), ("record", i + 1), ("wait", i + 1), ("read", i, i + 1))]


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_the_tuners_device_calls_on_cuda():
    """Unfaked on a GPU: the device as CUDA describes it; the cuBLAS engine's matmul of bf16
    operands in fp32 under the head's autocast (equal to their fp64 product up to fp32
    accumulation); CUDA events around a kernel that spins a million cycles read a time."""
    props = torch.cuda.get_device_properties(DEVICE)
    assert tuning.device_info(DEVICE) == tuning.Device(
        props.name, props.multi_processor_count, (props.major, props.minor))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    a, b = (torch.randn(*shape, generator=g, device=DEVICE).bfloat16()
            for shape in ((64, 512), (512, 96)))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = cublas._mm(a, b)
    assert got.dtype == torch.float32 and normwise(got, a.double() @ b.double()) < 1e-5
    assert autotune._timed(lambda: torch.cuda._sleep(1_000_000), DEVICE) > 0
