"""Declared seams: the few named points where training calls out to code attached at run time.

Fault injection (``tools/chaos``) and tests need a hand inside a training process — a NaN on
one rank at one step, a kill between two lines of a checkpoint replacement, a disk that
fills up, a rank that stops inside its backward. Replacing attributes of production code
(``PartialFC.forward = ...``) would miss silently after a rename. Instead the code fires a
seam declared here, once, with what it passes; a hook attaches by the seam's name, and
:func:`attach` refuses a name not declared, so a renamed or removed seam fails at once
(``tests/trainer/test_seams.py`` also proves each declared seam is fired by the code).

Cost with nothing attached: one Python call that loops over an empty tuple; no I/O, no
environment read, no tensor made, no host read. Hooks live in this process only (a
``torch.distributed.run`` worker attaches its own: ``python -m tools.chaos inject``).

A seam is called ``SEAM(value, **context)`` and returns ``value``, or the value a hook
returned in its place (a hook returning ``None`` leaves it). A hook may raise: the exception
leaves the seam as if the line after it had raised it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Hook = Callable[..., Any]


class Seam:
    """One declared point in the training code; ``doc`` says where it fires, on which ranks,
    with which arguments and what a hook may do there."""

    __slots__ = ("doc", "hooks", "name")

    def __init__(self, name: str, doc: str):
        self.name, self.doc = name, doc
        self.hooks: tuple[Hook, ...] = ()

    def __call__(self, value: Any, /, **context: Any) -> Any:
        for hook in self.hooks:
            result = hook(value, **context)
            if result is not None:
                value = result
        return value

    def __repr__(self) -> str:
        return f"Seam({self.name!r}, {len(self.hooks)} hook(s))"


HEAD_LOSS = Seam("head-loss", """\
``trainer.engine.Engine._forward``, every rank, each training micro-batch, right after the
head returned the global-batch loss and before its backward: ``hook(loss, rank=int)``,
``loss`` a 0-dim fp32 device tensor in the autograd graph. Returning a tensor computed from
it (``loss * nan``) replaces the loss the step backpropagates, checks and logs.""")

BACKBONE_BUILT = Seam("backbone-built", """\
``trainer.build.build``, every rank, once, after the backbone was built (and its initial
weights loaded), before an engine wraps it: ``hook(backbone, rank=int)``, the bare
``nn.Module`` on the CPU. A hook may register tensor or module hooks on it.""")

CHECKPOINT_WRITE = Seam("checkpoint-write", """\
``trainer.checkpoint.layout.save``, on each rank just before it writes one part of the
checkpoint of step ``step``: ``hook(path, step=int, rank=int)``, ``path`` the file or (DCP)
the folder under ``checkpoints/.tmp-<tag>/`` about to be written (``state``,
``rng-<rank>.pt``, and on rank 0 ``backbone.pt`` and ``meta.json``). A hook raising
``OSError`` stands for the storage refusing the bytes (ENOSPC, EIO): the save fails the
way a real write failure does.""")

CHECKPOINT_REPLACED = Seam("checkpoint-replaced", """\
``trainer.checkpoint.layout._replace``, rank 0, when the same step is saved again: after
``latest`` named the complete ``.tmp-<tag>`` and the old ``<tag>`` folder was removed,
before the rename: ``hook(final)``, ``final`` the removed folder's path. The one instant
where no ``step-*`` folder holds that step (a kill here must leave a resumable run).""")

SEAMS: dict[str, Seam] = {s.name: s for s in (HEAD_LOSS, BACKBONE_BUILT, CHECKPOINT_WRITE,
                                              CHECKPOINT_REPLACED)}
"""Every declared seam by name; the only ones :func:`attach` accepts."""


def attach(name: str, hook: Hook) -> Callable[[], None]:
    """Run ``hook`` (after any attached before it) each time seam ``name`` fires in this
    process; returns a function that detaches it. Raises ``KeyError`` naming the declared
    seams when ``name`` is not one of them."""
    seam = SEAMS.get(name)
    if seam is None:
        raise KeyError(f"no seam named {name!r}; declared: {', '.join(sorted(SEAMS))} "
                       f"(trainer/seams.py)")
    seam.hooks = (*seam.hooks, hook)

    def detach() -> None:
        seam.hooks = tuple(h for h in seam.hooks if h is not hook)

    return detach


def detach_all() -> None:
    """Remove every hook from every seam (tests, between cases)."""
    for seam in SEAMS.values():
        seam.hooks = ()
