"""Each batch's copy to the GPU queued on a side stream as the loader hands it over
(``engine.prefetch``), so that it runs beside the previous step's last kernels.

The host is ahead of the GPU when the loader hands the next batch over: the step's one host
read (its verdict, ``trainer.engine.backend``) comes before both optimizers' updates, which
the GPU is still running then (2.5 ms of a one-rank iresnet50 step at 1k classes, 9.9 ms at
1M rows, docs/benchmarks.md). Copied on the step's own stream (``Engine._on_device``), the
batch waits behind them; copied from its pinned memory on a side stream, it overlaps them on
the GPU's copy engine, and the next step's first kernel waits for the copy alone.

The ordering, per the CUDA semantics of torch's streams (docs: "CUDA semantics, CUDA
streams"):

1. under ``torch.cuda.stream(side)``: ``t.to(device, non_blocking=True)`` for every tensor of
   every micro-batch: the copies are queued on ``side``, and their destinations allocated
   from ``side``'s pool, fresh memory no kernel of the step's stream touches;
2. ``current.wait_stream(side)``: the step's stream (the one current when the batch is
   handed over) runs nothing queued after this point before the copies are done (a wait
   on the GPU; the host goes on);
3. ``out.record_stream(current)`` for every copy: the caching allocator, which counts the
   memory as ``side``'s, does not hand it to ``side`` again until what the step's stream
   has queued by the time it is freed has run.

The pinned source needs no care of its own: torch's pinned-memory allocator keeps it until
the copy queued from it (on ``side``) is done. A batch not in pinned memory is copied as
well, synchronously (torch's rule for pageable memory), as the step would. On a CPU device,
or with ``engine.prefetch=false``, batches pass through untouched and the step copies them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor


class Prefetch:
    """Queues each group of micro-batches' copy to ``device`` on one side stream (module
    docstring); ``enabled`` and a CUDA ``device`` both needed, else a pass-through."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device) if enabled and device.type == "cuda" else None

    def __call__(self, groups: Iterable[list[tuple]]) -> Iterator[list[tuple]]:
        """``groups`` (the loop's micro-batch groups), each on the device when handed on."""
        for group in groups:
            yield group if self.side is None else self.copied(group)

    def copied(self, group: list[tuple]) -> list[tuple]:
        """``group`` with every tensor on the device, ready for the current stream (steps
        1-3 of the module docstring); other items (a sample's key) as they were."""
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.side):
            out = [tuple(self._to_device(item) for item in batch) for batch in group]
        current.wait_stream(self.side)
        for batch in out:
            for item in batch:
                if isinstance(item, Tensor):
                    item.record_stream(current)
        return out

    def _to_device(self, item: object) -> object:
        return item.to(self.device, non_blocking=True) if isinstance(item, Tensor) else item
