"""What a skipped step puts back: the buffers its forwards wrote and the head's step count.

A forward writes BatchNorm's running statistics and (dynamic AdaCos) the head's scale in
place, before the step's verdict is known (``trainer.engine.backend.Verdict``); a step the
verdict turns down must leave them as they were. Any step can be turned down: a non-finite
loss or gradient is always checked for (``train.max_bad_steps`` has no off switch), so the
copy is made on every step, as one copy per (device, dtype) rather than one per buffer
(an iResNet-100 has several hundred BatchNorm buffers: one kernel launch each otherwise),
and read back only on a skip.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


class Snapshot:
    """The buffers of ``modules`` and ``head.step`` at construction; :meth:`restore` puts
    them back. ``head`` is a ``partial_fc.PartialFC`` (its ``step`` is a host int)."""

    def __init__(self, modules: Sequence[nn.Module], head: nn.Module):
        self.head, self.step = head, head.step
        groups: dict[tuple, list[Tensor]] = {}
        for module in modules:
            for buffer in module.buffers():
                groups.setdefault((buffer.device, buffer.dtype), []).append(buffer)
        with torch.no_grad():
            self.groups = [(buffers, torch.cat([b.detach().reshape(-1) for b in buffers]))
                           for buffers in groups.values()]

    def restore(self) -> None:
        """Every buffer and the head's step as they were when the snapshot was taken."""
        self.head.step = self.step
        with torch.no_grad():
            for buffers, flat in self.groups:
                values = flat.split([b.numel() for b in buffers])
                for buffer, value in zip(buffers, values, strict=True):
                    buffer.copy_(value.view_as(buffer))
