"""Which launch configuration the head's kernels run with on a GPU, and the tuning that decides it.

``TUNED`` is the back-end ``partial_fc.tiles.select`` gives a head on a GPU: each call runs
``TUNER.tiles(e, w)`` on its engine (:func:`engine`). ``TUNER.tiles`` is, for a CUDA device, the
choice (``partial_fc.tiles.tuning.Choice``: the engine, Triton GEMMs or cuBLAS matmuls with
Triton epilogues, and the tiles) for its name and the step's shape bucket, looked up once per
process in the committed table, then in the user's cache (a choice found there is checked
against the reference on this device before it runs: it was measured maybe with another
triton or torch); a bucket in neither is tuned at its first use (:func:`measure`), cached,
and said in one line (:func:`tuning.take_notes`, which the head's ``take_notes`` passes on).
Shapes under :data:`MIN_WORK` are not worth a tuning and run ``tuning.DEFAULT``; other devices
(the interpreter's CPU tensors) get None.

A tuning runs each candidate (``tuning.candidates``) on the step's own ``e`` and its first
:data:`COLUMNS` rows of ``w`` (each program already loops over many class tiles there; a
few ms a candidate at N = 1024), forward statistics and backward gradients, and compares the outputs
with the torch reference (normwise, ``partial_fc.tiles.selfcheck``'s tolerance). A candidate
that disagrees, or fails to compile or launch, is never chosen; the others are timed (median
of :data:`REPEATS` runs after the checked one) and the fastest wins.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from partial_fc.tiles import ReferenceTiles, cublas, tuning
from partial_fc.tiles import triton as tm
from partial_fc.tiles.selfcheck import normwise, tolerance

__all__ = ["COLUMNS", "MIN_WORK", "REPEATS", "TUNED", "TUNER", "Trial", "TunedKernels", "Tuner",
           "as_tiles", "describe", "engine", "measure"]

COLUMNS = 1 << 16
"""Classes a tuning runs on: a few ms a candidate at N = 1024, and its transient memory (the
reference's and a candidate's ``grad_w``, a ``G'`` chunk: ~400 MiB at N = 1024, D = 512)
under what the step's own backward holds at any S past it."""
REPEATS = 3
MIN_WORK = 1 << 31
"""``N S D`` below which a shape runs the default untuned: its matmuls take microseconds, and
the smallest shape users run (N 512, S 10k, D 512) is above it."""
SCALE = 64.0  # the logits' scale in a tuning (ArcFace's): any value gives the same timing


def as_tiles(choice: tuning.Choice, sms: int) -> tm.Tiles:
    """The kernels' ``Tiles`` for ``choice`` on a device with ``sms`` multiprocessors (the
    backward's ``G'`` budget is the kernels' own, ``cuda_tiles``)."""
    return tm.Tiles(choice.rows, choice.cols, choice.depth, choice.gemm, choice.num_warps,
                    choice.num_stages, programs=choice.programs_per_sm * sms,
                    buffer_bytes=tm.cuda_tiles(sms).buffer_bytes, engine=choice.engine)


def engine(tiles: tm.Tiles):
    """The module that runs ``tiles``: ``partial_fc.tiles.cublas`` (torch matmuls per chunk,
    Triton epilogues) or ``partial_fc.tiles.triton`` (Triton GEMMs); the same signatures."""
    return cublas if tiles.engine == "cublas" else tm


@dataclass(frozen=True)
class Trial:
    """One candidate of a tuning: its median ``ms`` (None when it was dropped), the largest
    normwise ``difference`` of its outputs from the reference, ``error`` the reason it was
    dropped (a compile or launch error's first line, or the difference past tolerance)."""

    choice: tuning.Choice
    ms: float | None
    difference: float
    error: str = ""


def measure(e: Tensor, w: Tensor, device: tuning.Device,
            choices: list[tuning.Choice] | None = None, timed: bool = True,
            columns: int = COLUMNS) -> list[Trial]:
    """``choices`` (default: every candidate for ``device``) on ``e [N, D]`` and the first
    ``columns`` rows of ``w`` (see the module docstring), each checked, then timed unless
    ``timed`` is False (its ``ms`` then 0 when it agreed); nothing is cached or chosen here."""
    with torch.no_grad():
        w = w[:columns].contiguous()
        n, cols = e.shape[0], w.shape[0]
        inv = 1.0 / w.float().norm(dim=1).clamp_min(1e-12)
        rows = torch.arange(n, device=e.device)
        targets = torch.where(rows % 2 == 0, rows % cols, -1)  # half the rows' targets here
        reference = ReferenceTiles(32 << 20)
        row_max, row_sum, cos_sum = reference.class_tile_stats(e, w, inv, targets, SCALE)
        row_lse = row_max + torch.log(row_sum)
        lse = torch.logaddexp(row_lse, torch.zeros_like(row_lse))  # a target logit of 0
        coef = torch.full_like(lse, SCALE / n)
        back = (lse, coef, torch.where(targets >= 0, -coef, 0.0))
        want = (row_lse, cos_sum, *reference.class_tile_grads(e, w, inv, targets, SCALE, *back))
        tol, trials = tolerance(e, w), []
        for choice in choices or tuning.candidates(device.capability):
            tiles = as_tiles(choice, device.sms)

            def run(tiles: tm.Tiles = tiles) -> tuple[Tensor, ...]:
                kernels = engine(tiles)
                m, s, c = kernels.class_tile_stats(e, w, inv, targets, SCALE, tiles=tiles)
                return (m + torch.log(s), c,
                        *kernels.class_tile_grads(e, w, inv, targets, SCALE, *back, tiles=tiles))

            try:
                got = run()
            except Exception as err:  # noqa: BLE001 - a failed compile or launch drops it
                first = (str(err).strip().splitlines() or [""])[0]
                trials.append(Trial(choice, None, float("inf"), f"{type(err).__name__}: {first}"))
                continue
            diff = max(normwise(a, b) for a, b in zip(got, want, strict=True))
            if not diff <= tol:
                trials.append(Trial(choice, None, diff, f"differs by {diff:.3g} (tolerance "
                                                        f"{tol:g})"))
                continue
            trials.append(Trial(choice, _timed(run, e.device) if timed else 0.0, diff))
    return trials


def _timed(run: Callable[[], object], device: torch.device) -> float:
    """Median ms of :data:`REPEATS` calls of ``run`` (CUDA events on a GPU)."""
    out = []
    for _ in range(REPEATS):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            run()
            end.record()
            end.synchronize()
            out.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(out)


def describe(choice: tuning.Choice) -> str:
    """A choice in words, for the one line a user sees."""
    engine = ("cuBLAS matmuls with Triton epilogues" if choice.engine == "cublas"
              else "Triton GEMMs")
    return (f"{engine}, tiles {choice.rows}x{choice.cols}x{choice.depth} (GEMM "
            f"{choice.gemm}), {choice.num_warps} warps x {choice.num_stages} stages, "
            f"{choice.programs_per_sm} programs/SM")


class Tuner:
    """The choices of one process, per device name and shape bucket (see the module
    docstring); ``table`` is the committed table's path, the cache is
    ``tuning.cache_path()`` at the time of the lookup."""

    def __init__(self, table: Path = tuning.TABLE) -> None:
        self.table = table
        self._chosen: dict[tuple[str, str], tm.Tiles] = {}

    def tiles(self, e: Tensor, w: Tensor) -> tm.Tiles | None:
        """The launch configuration for ``e [N, D]`` and ``w [S, D]`` on their device (None
        off CUDA); a bucket met for the first time may be tuned here (module docstring)."""
        device = tuning.device_info(e.device)
        if device is None:
            return None
        shape = tuning.Shape.of(e.shape[0], w.shape[0], e.shape[1], e.dtype, w.dtype)
        key = (device.name, shape.key)
        if key not in self._chosen:
            self._chosen[key] = as_tiles(self._choose(e, w, device, shape), device.sms)
        return self._chosen[key]

    def _choose(self, e: Tensor, w: Tensor, device: tuning.Device,
                shape: tuning.Shape) -> tuning.Choice:
        where = f"head: the class tiles on {device.name} for {shape.key}:"
        cache = tuning.cache_path()
        for choice, source in ((tuning.tabled(device, shape, self.table), "the committed table"),
                               (tuning.cached(device, shape, cache), f"tuned before, {cache}")):
            if choice is None:
                continue
            # measured on this device, maybe with another triton or torch: checked here first
            (trial,) = measure(e, w, device, [choice], timed=False)
            if trial.ms is None:
                tuning.note(f"{where} {describe(choice)} ({source}) fails here: {trial.error}; "
                            "the default tiles run")
                return tuning.DEFAULT
            tuning.note(f"{where} {describe(choice)} ({source})")
            return choice
        if e.shape[0] * w.shape[0] * e.shape[1] < MIN_WORK:
            return tuning.DEFAULT
        t0 = time.perf_counter()
        trials = measure(e, w, device)
        timed = [t for t in trials if t.ms is not None]
        if not timed:
            tuning.note(f"{where} no candidate agreed with the reference ({trials[0].error}); "
                        "the default tiles run")
            return tuning.DEFAULT
        best = min(timed, key=lambda t: t.ms)
        tuning.remember(device, shape, best.choice, cache)
        tuning.note(f"{where} {describe(best.choice)} (tuned now, not in the committed table: "
                    f"{best.ms:.2f} ms, the fastest of the {len(timed)} of {len(trials)} "
                    f"candidates that agreed with the reference, in "
                    f"{time.perf_counter() - t0:.1f} s; cached in {cache})")
        return best.choice


TUNER = Tuner()
"""The process's tuner, which ``partial_fc.tiles.triton`` asks."""


class TunedKernels:
    """The kernels' back-end (``partial_fc.tiles.TileBackend``): each call takes the
    configuration the process's :data:`TUNER` (read at the call) chose for its device and
    shape (the interpreter's tiles off a GPU) and runs it on that configuration's engine."""

    def _tiles(self, e: Tensor, w: Tensor) -> tm.Tiles:
        return TUNER.tiles(e, w) or tm.default_tiles(e)

    def class_tile_stats(self, e: Tensor, w: Tensor, inv_norm: Tensor, target_col: Tensor,
                         s: Tensor | float, nontarget=None) -> tuple[Tensor, Tensor, Tensor]:
        """``partial_fc.tiles.triton.class_tile_stats`` with the tuned configuration."""
        tiles = self._tiles(e, w)
        return engine(tiles).class_tile_stats(e, w, inv_norm, target_col, s, nontarget,
                                              tiles=tiles)

    def class_tile_grads(self, e: Tensor, w: Tensor, inv_norm: Tensor, target_col: Tensor,
                         s: Tensor | float, lse: Tensor, coef: Tensor, target_grad: Tensor,
                         nontarget=None, skip=None) -> tuple[Tensor, Tensor]:
        """``partial_fc.tiles.triton.class_tile_grads`` with the tuned configuration; the
        filtered backward (``skip``) on the Triton GEMMs (the default tiles where the cuBLAS
        engine was chosen: a cuBLAS matmul cannot skip a tile)."""
        tiles = self._tiles(e, w)
        if skip is None:
            return engine(tiles).class_tile_grads(e, w, inv_norm, target_col, s, lse, coef,
                                                  target_grad, nontarget, tiles=tiles)
        tiles = tiles if tiles.engine == "triton" else tm.default_tiles(e)
        return tm.class_tile_grads(e, w, inv_norm, target_col, s, lse, coef, target_grad,
                                   nontarget, tiles=tiles, skip=skip)


TUNED = TunedKernels()
