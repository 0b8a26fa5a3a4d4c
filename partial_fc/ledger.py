"""The hand-off between the head's forwards and its row-sampling optimizer.

``PartialFC``'s forwards use some rows of ``weight`` (all of them at ``sample_rate == 1``,
the sampled ones below); ``partial_fc.optim`` must update exactly those, once per
optimisation step, from the :class:`partial_fc.rows.SampledRows` a loop pops. The
:class:`RowLedger` keeps that account for the head: the rows used since the last pop, and
the one mistake it can catch, a loop that forgets a pop (docs/design.md, "The head's row ledger").
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from partial_fc.rows import SampledRows


class RowLedger:
    """The rows of a head's ``weight`` used since the last :meth:`pop`.

    ``num_local`` rows and ``sample_rate`` as the head's. Only forwards
    with grad enabled are counted (an evaluation forward changes no row).
    """

    def __init__(self, num_local: int, sample_rate: float):
        self.num_local, self.sample_rate = num_local, sample_rate
        self.rows: Tensor | None = None  # sorted unique int64; None: no forward, or all rows
        self.all_rows = False
        self.forwards = 0  # forwards since the last pop
        self.shared = True  # every forward since the last pop recorded the same index object
        self.pops = 0
        self._backward_seen = False  # a backward reached weight.grad since the last pop
        self._hooked = None  # a weakref to the hooked weight (a strong one would keep it)

    def before_forward(self, weight: nn.Parameter) -> None:
        """Call at the start of each forward. Raises when a loop that pops forgot a pop: rows
        are pending whose gradient reached ``weight.grad`` and was cleared since, so they
        would be updated with the next step's rows."""
        self._watch(weight)
        if self.pops and self._backward_seen and weight.grad is None \
                and torch.is_grad_enabled():
            raise RuntimeError(
                f"PartialFC: the rows of {self.forwards} earlier forward(s) were never "
                "popped and weight.grad was cleared since; call head.pop_sampled_rows() once "
                "every step, also a skipped one")

    def record(self, index: Tensor | None) -> None:
        """Add a forward's rows (``index``: sorted, unique; None = all) in ``O(S log S)``,
        never an ``O(num_local)`` mask: the first forward's index is kept as is, later ones
        (gradient accumulation) are merged by ``torch.unique``, except the same index again
        (a ``begin_step`` sample, shared by the step's forwards)."""
        if self.sample_rate == 1.0 or not torch.is_grad_enabled() or self.all_rows:
            return
        self.forwards += 1
        if index is None:
            self.rows, self.all_rows = None, True
        elif self.rows is None:
            self.rows = index
        elif index is not self.rows:
            self.rows, self.shared = torch.unique(torch.cat([self.rows, index])), False

    def pop(self, weight: nn.Parameter) -> SampledRows:
        """The rows since the last pop, for ``head_opt.step(rows)``; the ledger
        starts empty again. After one forward ``rows.index`` is the sampler's own index."""
        rows, every, forwards, shared = self.rows, self.all_rows, self.forwards, self.shared
        self.rows, self.all_rows, self.forwards, self._backward_seen = None, False, 0, False
        self.shared = True
        if self.sample_rate == 1.0 or every or (rows is not None and len(rows) == self.num_local):
            index = None
        elif rows is None:
            index = torch.zeros(0, dtype=torch.int64, device=weight.device)
        else:
            index = rows
        self.pops += 1
        return SampledRows(weight, index, forwards, self.pops, shared and rows is index)

    def _watch(self, weight: nn.Parameter) -> None:
        """Hook ``weight`` once (a deep copy or a swapped weight gets its own hook), so that a
        backward into ``weight.grad`` marks the pending rows as having a gradient."""
        if (self._hooked is not None and self._hooked() is weight) or not weight.requires_grad:
            return
        me = weakref.ref(self)

        def seen(_p: Tensor) -> None:
            ledger = me()
            if ledger is not None and ledger.forwards:
                ledger._backward_seen = True

        weight.register_post_accumulate_grad_hook(seen)
        self._hooked = weakref.ref(weight)
