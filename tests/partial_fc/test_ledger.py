"""``partial_fc.ledger.RowLedger``: the rows a pop hands over, and the forgotten pop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partial_fc.ledger import RowLedger


def _weight() -> nn.Parameter:
    return nn.Parameter(torch.zeros(10, 2))


def test_a_pop_hands_over_the_union_of_the_forwards_rows_once():
    ledger, w = RowLedger(10, 0.5), _weight()
    first, second = torch.tensor([1, 4]), torch.tensor([2, 4, 7])
    ledger.record(first)
    rows = ledger.pop(w)
    assert rows.index is first and rows.forwards == 1 and rows.pop == 1  # no copy
    ledger.record(first)
    ledger.record(first)  # a begin_step sample again: not merged
    ledger.record(second)
    rows = ledger.pop(w)
    assert rows.index.tolist() == [1, 2, 4, 7] and rows.forwards == 3 and rows.pop == 2
    empty = ledger.pop(w)
    assert empty.empty and empty.forwards == 0
    with torch.no_grad():
        ledger.record(second)  # an evaluation forward uses no row
    assert ledger.pop(w).empty


@pytest.mark.parametrize("rate, index", [(1.0, [3]), (0.5, None), (0.5, list(range(10)))])
def test_all_rows_pop_as_none(rate, index):
    ledger = RowLedger(10, rate)
    ledger.record(None if index is None else torch.tensor(index))
    assert ledger.pop(_weight()).index is None


def _forward_backward(ledger: RowLedger, w: nn.Parameter) -> None:
    ledger.before_forward(w)
    ledger.record(torch.tensor([1]))
    (w[1].sum() * 1.0).backward()


def test_a_forgotten_pop_raises_at_the_next_forward_only_in_a_loop_that_pops():
    ledger, w = RowLedger(10, 0.5), _weight()
    _forward_backward(ledger, w)
    w.grad = None  # a loop that never pops (no optimizer): nothing to police
    _forward_backward(ledger, w)
    ledger.pop(w)
    _forward_backward(ledger, w)
    ledger.before_forward(w)  # the gradient is still there: the step is not over
    w.grad = None  # the step was skipped and its gradient cleared, but not popped
    with pytest.raises(RuntimeError, match="never popped"):
        ledger.before_forward(w)
    ledger.pop(w)
    ledger.before_forward(w)  # popped: fine again
    copy = _weight()  # another Parameter gets its own hook
    _forward_backward(ledger, copy)
    copy.grad = None
    with pytest.raises(RuntimeError, match="never popped"):
        ledger.before_forward(copy)
