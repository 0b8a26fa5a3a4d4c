"""Step statistics that stay on the device until someone reads them.

Turning a CUDA tensor into a Python number (``.item()``, ``float(t)``) makes the host wait
until the GPU has run everything queued before it, so the next kernels cannot be queued
ahead and the GPU idles while the host catches up. A training step's loss and statistics are
therefore kept as 0-d tensors in a :class:`DeviceScalars`, a read-only mapping that copies
them to the host together, in one transfer, the first time a value is asked for (the
trainer's logger does so every ``log.every`` steps), and keeps the floats from then on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["DeviceScalars"]


class DeviceScalars(Mapping[str, Any]):
    """``{name: value}`` where tensor values (0-d or one element) are read on first access.

    Args:
        values: the step's values; tensors are detached and read as fp64 (exactly their
            fp32/fp64 value, as ``.item()`` gives it), anything else is kept as it is.
        finish: maps the host values to the final mapping (derived numbers such as an
            ``exp`` of a logarithm), run once at the read; without it, the keys and the
            values that are not tensors are answered without touching the device.
    """

    def __init__(self, values: Mapping[str, Any],
                 finish: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        self._values, self._finish = dict(values), finish
        self._host: dict[str, Any] | None = None

    def _read(self) -> dict[str, Any]:
        if self._host is None:
            names = [k for k, v in self._values.items() if isinstance(v, Tensor)]
            host = dict(self._values)
            if names:
                device = self._values[names[0]].device
                flat = torch.cat([self._values[k].detach().reshape(1).to(device, torch.float64)
                                  for k in names])
                host.update(zip(names, flat.tolist(), strict=True))  # the one host read
            self._host = self._finish(host) if self._finish else host
        return self._host

    def __getitem__(self, key: str) -> Any:
        if self._host is None and self._finish is None and key in self._values \
                and not isinstance(self._values[key], Tensor):
            return self._values[key]
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values if self._finish is None else self._read())

    def __len__(self) -> int:
        return len(self._values if self._finish is None else self._read())

    def __repr__(self) -> str:
        if self._host is None:
            return f"DeviceScalars(unread: {', '.join(self._values)})"
        return f"DeviceScalars({self._host!r})"
