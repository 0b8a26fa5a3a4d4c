"""Count the device-to-host reads in a region of code, on any device (CPU included).

On CUDA every read of a tensor's value by the host (``.item()``, ``bool(t)``, an output
whose size depends on the data, ...) makes the CPU wait until the GPU has run everything
queued before it, so the kernels of what follows cannot be queued ahead: one such stall per
step costs throughput. ``torch.cuda.set_sync_debug_mode`` catches them on a GPU only;
this counter intercepts the same calls through ``torch.overrides.TorchFunctionMode``, so a
CPU test can hold a step to a budget of reads::

    with HostReads() as reads:
        engine.step(...)
    assert len(reads) == 1, reads.table()

What counts: the methods that hand a value to Python (``item``, ``tolist``, ``__bool__``,
``__int__``, ``__float__``, ``__index__``, ``__format__``, ``cpu``, ``numpy``, ``equal``,
``allclose``, ``is_nonzero``), the ops whose output size depends on the data (``nonzero``,
``argwhere``, ``unique``, ``unique_consecutive``, ``masked_select``, ``repeat_interleave``
without ``output_size``) and indexing with a boolean mask (``x[mask]``; ``x[mask] = tensor``,
while ``x[mask] = 3.0`` is a ``masked_fill`` and reads nothing). Counted too, as ``upload``:
a Python number written through any other index (``x[i] = 3``). torch lifts the number into
a host tensor and copies it over, from pageable memory, which the host waits for as for a
read (the first GPU run, 2026-11-27, caught the head's statistics doing this every step;
``x[i].fill_(3)`` passes the number as a kernel argument instead). Not counted: collectives
(they wait on the device, not the host), ``.to("cpu")`` (on a CPU run it cannot be told from
a host tensor moved to the CPU device), and reads inside C++ that never reach Python.
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode

__all__ = ["HostReads"]

ROOT = Path(__file__).resolve().parent.parent
VALUE_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__",
                         "__format__", "cpu", "numpy", "equal", "allclose", "is_nonzero"})
DATA_SIZED = frozenset({"nonzero", "argwhere", "unique", "unique_consecutive", "masked_select"})


def _has_mask(index) -> bool:
    parts = index if isinstance(index, tuple | list) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype in (torch.bool, torch.uint8)
               for p in parts)


def _is_read(name: str, args: tuple, kwargs: dict) -> bool:
    if name in VALUE_READS or name in DATA_SIZED:
        return True
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None and isinstance(
            kwargs.get("repeats", args[1] if len(args) > 1 else None), torch.Tensor)
    if name == "__getitem__":
        return _has_mask(args[1])
    if name == "__setitem__":
        return isinstance(args[2], torch.Tensor) == _has_mask(args[1])
    return False


def _caller() -> str:
    """``file:line function`` of the innermost frame in this repository outside tests/."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename).resolve()
        if (path.is_relative_to(ROOT) and not path.is_relative_to(ROOT / "tests")
                and "site-packages" not in path.parts):  # a venv inside the checkout
            return f"{path.relative_to(ROOT)}:{frame.lineno} {frame.name}"
    frame = traceback.extract_stack()[-3]
    return f"{frame.filename}:{frame.lineno} {frame.name}"


class HostReads(TorchFunctionMode):
    """Context manager recording every host read as ``(what, where)`` in ``self.reads``.

    ``where`` is the innermost frame of this repository's code (``partial_fc/``, ``launch/``,
    ...) that led to the read, so a read inside torch or DeepSpeed is charged to the call
    that asked for it. ``len(self)`` is the count; ``places()`` counts them by file and
    function, ``table()`` lists them by line."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []
        self._depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _is_read(name, args, kwargs):
            self.reads.append(("upload" if name == "__setitem__" and not _has_mask(args[1])
                               else name, _caller()))
        return func(*args, **kwargs)

    def __enter__(self):
        # Autograd runs a custom Function's backward with no mode on the stack (the head's
        # backward is one): the outermost entry re-enters this counter around every Python
        # backward until it exits.
        self._depth += 1
        if self._depth == 1:
            original = BackwardCFunction.apply

            def apply(ctx, *args):
                with self:
                    return original(ctx, *args)

            self._restore = original
            BackwardCFunction.apply = apply
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            BackwardCFunction.apply = self._restore
        return super().__exit__(*exc)

    def __len__(self) -> int:
        return len(self.reads)

    def places(self) -> Counter:
        """``{"file function": count}``: where the reads come from, without line numbers (a
        budget that survives edits elsewhere in the file)."""
        return Counter(where.split(":")[0] + " " + where.rsplit(" ", 1)[1]
                       for _, where in self.reads)

    def table(self) -> str:
        """One line per (read, place) with its count, most frequent first."""
        rows = Counter(self.reads).most_common()
        return "\n".join(f"{n:3d} x {what:<12} {where}" for (what, where), n in rows) or "none"
