"""The head's first-use check of its class-tile kernels against the torch reference.

The Triton kernels (``partial_fc.tiles.triton``) are tested against the reference in the
interpreter, but a new GPU, driver or triton version can still miscompile or fail to launch
them. So on the first forward on a device where the head would run them, it computes a slice
of that step, at most ``ROWS`` samples x ``COLS`` classes of its own shard (every target of
those rows included, so the margin's target path is exercised), both ways: the forward's
statistics and the backward's gradients, the latter from the step's own margin ``psi`` and
scale (``coef = s / n``, the target gradient ``(p_y - 1) psi'(cos_y) coef``, as
``partial_fc.softmax`` passes them). A margin's non-target transform (``partial_fc.nontarget``)
launches other compiled variants of the kernels, so the first step that hands the tiles one
checks that variant too, on the same slice with the step's transform (and CurricularFace's
hard-negative counts as one more output).

Tolerance (normwise: ``max |kernel - reference| / max |reference|`` per output): ``1e-3`` when
the dots are IEEE fp32 (fp32 ``e`` and ``w``, ``torch.get_float32_matmul_precision() ==
"highest"``), ``3e-2`` when they round their operands (bf16/fp16, or TF32). Both are the
interpreter tests' own bounds for the largest gradient entry (``tests/partial_fc/
test_tiles.py``): a correct kernel stays far inside them (observed ~1e-6), a wrong index, mask
or reduction lands far outside.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from partial_fc import distributed as dist_ops
from partial_fc.nontarget import NonTarget
from partial_fc.tiles import ReferenceTiles, TileBackend, select, tuning

__all__ = ["COLS", "ROWS", "CheckedTiles", "Disagreement", "KernelCheckFailed", "compare",
           "first_use", "normwise", "tolerance"]

ROWS, COLS = 256, 256
_EXACT, _ROUNDED = 1e-3, 3e-2
_STATS = ("row_lse", "cos_sum", "hard_rows")  # row_lse = row_max + log(row_sum): the one
# number the loss uses; hard_rows: CurricularFace's hard negatives per row (0 without them)
_GRADS = ("grad_e", "grad_w")


@dataclass(frozen=True)
class Disagreement:
    """Why a back-end failed the check: ``kernel`` (``class_tile_stats`` |
    ``class_tile_grads``), ``output`` (the compared output, or ``"launch"`` when it raised),
    ``difference`` (normwise; ``inf`` for a raise or a non-finite output), ``tolerance``,
    ``error`` (the exception's first line, if it raised)."""

    kernel: str
    output: str
    difference: float
    tolerance: float
    error: str = ""

    def describe(self) -> str:
        if self.error:
            return f"{self.kernel} failed to compile or launch: {self.error}"
        return (f"{self.kernel} disagrees with the torch reference: {self.output} differs by "
                f"{self.difference:.3g} (tolerance {self.tolerance:g})")


def tolerance(e: Tensor, w: Tensor) -> float:
    """The normwise tolerance for operands ``e``, ``w`` (see the module docstring)."""
    exact = e.dtype == w.dtype == torch.float32 \
        and torch.get_float32_matmul_precision() == "highest"
    return _EXACT if exact else _ROUNDED


def compare(candidate: TileBackend, reference: TileBackend, e: Tensor, w: Tensor,
            inv_norm: Tensor, targets: Tensor, s: Tensor | float,
            psi: Callable[[Tensor], Tensor], nontarget: NonTarget | None = None
            ) -> Disagreement | None:
    """Run both back-ends on a slice of one step (the ``TileBackend`` arguments of the whole
    shard; ``psi`` the margin's target transform at this step, ``nontarget`` its non-target
    transform or None) and return the first output beyond tolerance, or ``None`` when they
    agree. An exception from ``candidate`` is a disagreement (``output="launch"``); one from
    ``reference`` is a bug and propagates."""
    e, w, inv_norm, targets, nontarget = _slice(e, w, inv_norm, targets, nontarget)
    tol = tolerance(e, w)

    def stats(tiles: TileBackend) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        hard = torch.zeros(e.shape[0], device=e.device)  # stays 0 without CurricularFace
        step = {} if nontarget is None else {"nontarget": dataclasses.replace(
            nontarget, hard_rows=hard if nontarget.hard_above is not None else None)}
        return (*tiles.class_tile_stats(e, w, inv_norm, targets, s, **step), hard)

    def grads(tiles: TileBackend) -> tuple[Tensor, Tensor]:
        step = {} if nontarget is None else {"nontarget": nontarget}
        return tiles.class_tile_grads(e, w, inv_norm, targets, s, *back, **step)

    with torch.no_grad():
        want = stats(reference)
    back = _backward_inputs(e, w, inv_norm, targets, s, psi, want[:3])
    ref_stats = _stat_outputs(*want)
    ref_grads = grads(reference)
    for kernel, names, run, ref in (
            ("class_tile_stats", _STATS, lambda: _stat_outputs(*stats(candidate)), ref_stats),
            ("class_tile_grads", _GRADS, lambda: grads(candidate), ref_grads)):
        try:
            with torch.no_grad():
                got = run()
        except Exception as err:  # noqa: BLE001 - any compile/launch failure is the verdict
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            return Disagreement(kernel, "launch", float("inf"), tol,
                                f"{type(err).__name__}: {first}")
        for name, a, b in zip(names, got, ref, strict=True):
            diff = normwise(a, b)
            if not diff <= tol:
                return Disagreement(kernel, name, diff, tol)
    return None


def _slice(e, w, inv_norm, targets, nontarget):
    """The first ``ROWS`` rows and the first ``COLS`` columns plus those rows' targets,
    targets remapped to the slice's columns; the transform with those rows' thresholds and
    no ``hard_rows`` (the check counts into its own)."""
    e, targets = e[:ROWS], targets[:ROWS]
    cols = torch.arange(min(COLS, w.shape[0]), device=w.device)
    cols = torch.unique(torch.cat([cols, targets[targets >= 0]]))  # sorted
    col = torch.where(targets >= 0, torch.searchsorted(cols, targets.clamp_min(0)), -1)
    if nontarget is not None:
        rows = None if nontarget.hard_above is None else nontarget.hard_above[:ROWS].contiguous()
        nontarget = dataclasses.replace(nontarget, hard_above=rows, hard_rows=None)
    return e.contiguous(), w[cols].contiguous(), inv_norm[cols].contiguous(), col, nontarget


def _backward_inputs(e, w, inv_norm, targets, s, psi, stats):
    """``(lse, coef, target_grad)`` of the slice as its own global batch (one shard)."""
    row_max, row_sum, _ = stats
    owned = targets >= 0
    cols = targets.clamp_min(0)
    cos_t = ((e.float() * w[cols].float()).sum(dim=1) * inv_norm[cols]).detach()
    with torch.enable_grad():
        c = cos_t.clone().requires_grad_()
        value = psi(c)
        (slope,) = torch.autograd.grad(value.sum(), c)
    t_logit = torch.where(owned, value.detach() * s, -torch.inf)
    lse = torch.logaddexp(row_max + torch.log(row_sum), t_logit)
    coef = torch.full_like(lse, float(s) / e.shape[0])
    target_grad = torch.where(owned, (torch.exp(t_logit - lse) - 1.0) * slope * coef, 0.0)
    return lse.float().contiguous(), coef.float().contiguous(), target_grad.float().contiguous()


def _stat_outputs(row_max: Tensor, row_sum: Tensor, cos_sum: Tensor, hard_rows: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor]:
    return row_max + torch.log(row_sum), cos_sum, hard_rows


def normwise(got: Tensor, want: Tensor) -> float:
    """``max |got - want| / max |want|`` over the finite entries of ``want`` (a row with no
    non-target column has ``-inf`` there, which ``got`` must match); ``inf`` on any mismatch
    of shape or of those infinities, or a non-finite ``got``."""
    got, want = got.double(), want.double()
    if got.shape != want.shape:
        return float("inf")
    finite = torch.isfinite(want)
    if not torch.equal(got[~finite], want[~finite]) or not torch.isfinite(got[finite]).all():
        return float("inf")
    if not finite.any():
        return 0.0
    scale = want[finite].abs().max().clamp_min(1e-30)
    return float((got[finite] - want[finite]).abs().max() / scale)


class KernelCheckFailed(RuntimeError):
    """``kernel="triton"`` and the kernels failed the first-use check (on some rank)."""


_KERNELS = ("class_tile_stats", "class_tile_grads")
_OUTPUTS = ("launch", *_STATS, *_GRADS)


def first_use(candidate: TileBackend, reference: TileBackend, e: Tensor, w: Tensor,
              inv_norm: Tensor, targets: Tensor, s: Tensor | float,
              psi: Callable[[Tensor], Tensor], strict: bool, process_group=None,
              nontarget: NonTarget | None = None) -> str | None:
    """:func:`compare` on every rank of ``process_group`` (collective: one all-gather of five
    numbers), so that all ranks learn of a failure anywhere and act alike. Returns ``None``
    when every rank's kernels agree, else the one line saying which kernel failed where, by
    how much, and that the run goes on with ``head.kernel=torch``; with ``strict``
    (``head.kernel=triton``) raises :class:`KernelCheckFailed` with that line instead."""
    bad = compare(candidate, reference, e, w, inv_norm, targets, s, psi, nontarget)
    mine = torch.zeros(1, 5, dtype=torch.float64, device=e.device)
    if bad is not None:
        mine[0] = torch.tensor([1.0, _KERNELS.index(bad.kernel), _OUTPUTS.index(bad.output),
                                min(bad.difference, 1e300), bad.tolerance])
    every = dist_ops.all_gather(mine, process_group).cpu()
    failed = every[:, 0].nonzero().flatten().tolist()
    if not failed:
        return None
    rank = dist_ops.get_rank(process_group)
    first = rank if rank in failed else failed[0]
    if first == rank:
        what = bad.describe()
    else:
        _, k, o, diff, tol = every[first].tolist()
        what = Disagreement(_KERNELS[int(k)], _OUTPUTS[int(o)], diff, tol,
                            "see that rank's log" if int(o) == 0 else "").describe()
    where = f"rank {first}" + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else "")
    if strict:
        raise KernelCheckFailed(f"head: the Triton kernels failed their first-use check on "
                                f"{where}: {what}; head.kernel=triton makes this fatal: use "
                                f"head.kernel=auto to go on with the torch path")
    return (f"head: the Triton kernels failed their first-use check on {where}: {what}; "
            f"going on with the torch path (head.kernel=torch)")


class CheckedTiles:
    """The class-tile back-end a head runs on each device: ``partial_fc.tiles.select``'s
    choice for ``kernel``, checked on its first use on a device (:func:`first_use`) unless it
    is the torch reference, and the reference there from then on if the check failed.
    Sub-centers (``subcenters > 1``) always take the reference: the kernels have no K-way max.
    ``notes``: one line for each of these choices a user should see."""

    def __init__(self, kernel: str, max_tile_bytes: int, subcenters: int = 1) -> None:
        self.kernel, self.max_tile_bytes, self.subcenters = kernel, max_tile_bytes, subcenters
        self.notes: list[str] = []
        self._taken = 0
        self._checked: set[tuple] = set()  # (device, transform variant)
        self._failed: set[torch.device] = set()
        if subcenters > 1 and kernel == "auto":
            self.notes.append(f"head: margin.subcenters={subcenters} runs the class tiles on "
                              "the torch path (head.kernel=torch): the Triton kernels have no "
                              "K-way max")

    def for_device(self, device: torch.device) -> TileBackend:
        if self.subcenters > 1 or device in self._failed:
            return ReferenceTiles(self.max_tile_bytes, self.subcenters)
        return select(self.kernel, device, self.max_tile_bytes)

    def checked(self, tiles: TileBackend, e: Tensor, w: Tensor, inv_norm: Tensor,
                targets: Tensor, s: Tensor | float, psi: Callable[[Tensor], Tensor],
                process_group=None, nontarget: NonTarget | None = None) -> TileBackend:
        """``tiles`` (:meth:`for_device`'s, for this step's ``TileBackend`` arguments and
        non-target transform), or the reference when this is the first use on ``e``'s device
        of the kernels for this kind of transform (none, or which of its parts are set) and
        they fail the check (then a note says so; ``kernel="triton"``:
        :class:`KernelCheckFailed`). Collective on that first use, on every rank of
        ``process_group`` (whose margins hand the tiles the same kind of transform)."""
        device = e.device
        key = (device, None if nontarget is None else (
            nontarget.clamp, nontarget.tau is not None, nontarget.hard_above is not None))
        if key in self._checked or isinstance(tiles, ReferenceTiles):
            return tiles
        self._checked.add(key)
        note = first_use(tiles, ReferenceTiles(self.max_tile_bytes), e, w, inv_norm, targets,
                         s, psi, strict=self.kernel == "triton", process_group=process_group,
                         nontarget=nontarget)
        if note is None:
            return tiles
        self.notes.append(note)
        self._failed.add(device)
        return self.for_device(device)

    def take_notes(self) -> list[str]:
        """The :attr:`notes` not taken yet, each once, then the kernels' configuration
        choices made since the last call (``partial_fc.tiles.tuning``)."""
        new, self._taken = self.notes[self._taken:], len(self.notes)
        return new + tuning.take_notes()
