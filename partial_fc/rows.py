"""What a ``PartialFC`` head hands its optimizer after the forwards of one step.

``rows = head.pop_sampled_rows()`` once per step (also a skipped one), then
``head_opt.step(rows)`` when the step is taken: the hand-off is this value, not state the
optimizer reads off the head. ``pop`` numbers each value, so an optimizer refuses to step
twice with the same rows or with rows older than the last ones it took.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["SampledRows"]


@dataclass(frozen=True, eq=False)
class SampledRows:
    """The rows of ``weight`` the forwards (grad enabled) since the previous pop used.

    ``index``: sorted unique local rows (int64, on the weight's device); ``None`` = all rows
    (always so at ``sample_rate == 1``); empty = no forward. ``forwards``: how many forwards
    they came from; with one, a row-sparse gradient holding ``len(index)`` rows holds exactly
    these, in this order, which the optimizer then need not check on the host. ``pop``: the
    head's pop counter (1, 2, ...). ``shared``: every forward used this very ``index`` (a
    ``begin_step`` sample shared by the step's micro-batches), so the head's row-sparse
    gradient holds ``m <= forwards`` copies of it in turn (autograd's accumulation
    concatenates them; the CPU's merges them into one), which the optimizer need not check
    on the host either.
    """

    weight: Tensor
    index: Tensor | None
    forwards: int
    pop: int
    shared: bool = False

    @property
    def empty(self) -> bool:
        """No forward used a row: nothing to update."""
        return self.index is not None and self.index.numel() == 0
