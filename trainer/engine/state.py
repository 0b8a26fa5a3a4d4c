"""An engine's training state, by section: what ``Engine.state_dict()`` returns and
``Engine.load_state_dict()`` takes, and what a checkpoint stores (``trainer.checkpoint``).

Every entry is one tensor of one of two kinds:

* :class:`Rows` — this rank's block ``[offset, offset + n)`` of a ``[num_classes * K, ...]``
  tensor: the head's weight rows and every per-row tensor of the head's optimizer. Saved
  as one logical tensor, so a run resumed on any number of ranks reads exactly its rows.
* a plain tensor, identical on every rank (replicated): the backbone's weights, its
  optimizer's state in *full* (un-partitioned) form, the head's step and scale state and any
  scalar optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from torch import Tensor


@dataclass(frozen=True)
class Rows:
    """Rows ``[offset, offset + local.shape[0])`` of a tensor with ``total`` rows."""

    local: Tensor
    offset: int
    total: int


@dataclass(frozen=True)
class EngineState:
    """The sections of an engine's state; :meth:`flat` names each entry by its section's
    prefix (:attr:`PREFIXES`) and its key there, as a checkpoint stores it.

    ``head``: the head's ``state_dict`` (``weight`` as :class:`Rows`). ``head_optimizer``:
    the row-sampling optimizer's state of the head's weight (per-row tensors as
    :class:`Rows`). ``backbone``: the bare backbone's ``state_dict``. ``backbone_optimizer``:
    the backbone optimizer's state as its engine names it
    (``trainer.engine.backend.BackboneBackend.optimizer_state``).
    """

    head: dict[str, Tensor | Rows]
    head_optimizer: dict[str, Tensor | Rows]
    backbone: dict[str, Tensor]
    backbone_optimizer: dict[str, Tensor]

    PREFIXES: ClassVar[dict[str, str]] = {"head": "head.", "head_optimizer": "head_opt.",
                                          "backbone": "backbone.",
                                          "backbone_optimizer": "backbone_"}

    def flat(self) -> dict[str, Tensor | Rows]:
        """``{prefix + key: entry}`` over every section."""
        return {self.PREFIXES[f.name] + key: value for f in fields(self)
                for key, value in getattr(self, f.name).items()}

    @classmethod
    def from_flat(cls, flat: dict[str, Tensor]) -> EngineState:
        """The sections of :meth:`flat`'s names (rows already this rank's plain tensors)."""
        sections: dict[str, dict[str, Tensor]] = {name: {} for name in cls.PREFIXES}
        for key, value in flat.items():
            name = next((n for n, p in cls.PREFIXES.items() if key.startswith(p)), None)
            if name is None:
                raise KeyError(f"{key!r}: in no section of an engine's state "
                               f"({', '.join(cls.PREFIXES.values())})")
            sections[name][key[len(cls.PREFIXES[name]):]] = value
        return cls(**sections)
