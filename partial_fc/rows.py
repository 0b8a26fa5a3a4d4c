"""What a ``PartialFC`` head hands its optimizer after the forwards of one step.

``rows = head.pop_sampled_rows()`` once per step (also a skipped one), then
``head_opt.step(rows)`` when the step is taken: the hand-off is this value, not state the
optimizer reads off the head. ``pop`` numbers each value, so an optimizer refuses to step
twice with the same rows or with rows older than the last ones it took.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SampledRows", "check_label_range"]


def check_label_range(y: Tensor, num_classes: int) -> None:
    """Raise the one-line error for the first gathered label outside ``[0, num_classes)``
    (reads the host; every rank sees the same gathered labels, so all raise together)."""
    bad = (y < 0) | (y >= num_classes)
    if bool(bad.any()):
        raise ValueError(f"PartialFC: label {int(y[bad][0])} out of range "
                         f"[0, {num_classes}) (num_classes={num_classes})")


@dataclass(frozen=True, eq=False)
class SampledRows:
    """The rows of ``weight`` the forwards (grad enabled) since the previous pop used.

    ``index``: sorted unique local rows (int64, on the weight's device); ``None`` = all rows
    (always so at ``sample_rate == 1``); empty = no forward. ``forwards``: how many forwards
    they came from; with one, a row-sparse gradient holding ``len(index)`` rows holds exactly
    these, in this order, which the optimizer then need not check on the host. ``pop``: the
    head's pop counter (1, 2, ...). ``deferred_labels``: the gathered labels of the forwards
    run with ``defer_label_check=True``, whose range :meth:`labels_ok` and
    :meth:`raise_label_error` check.
    """

    weight: Tensor
    index: Tensor | None
    forwards: int
    pop: int
    num_classes: int
    deferred_labels: tuple[Tensor, ...] = ()

    @property
    def empty(self) -> bool:
        """No forward used a row: nothing to update."""
        return self.index is not None and self.index.numel() == 0

    def labels_ok(self) -> Tensor:
        """Whether every deferred label lies in ``[0, num_classes)``: a 0-d bool on the device,
        the same on all ranks, read by nobody here, so the caller can fold it into a flag it
        reads anyway (the trainer's one all-reduce of a step)."""
        ok = torch.ones((), dtype=torch.bool, device=self.weight.device)
        for y in self.deferred_labels:
            ok = ok & ~((y < 0) | (y >= self.num_classes)).any()
        return ok

    def raise_label_error(self) -> None:
        """Raise the error an immediate check of the deferred labels would have raised, if one
        is out of range (reads the host)."""
        for y in self.deferred_labels:
            check_label_range(y, self.num_classes)
