"""How a margin declares its config keys, and the one check every key goes through.

A margin family's file declares each type's own keys as a frozen dataclass whose fields are
made by :func:`key` (default, one-line description, bounds); ``partial_fc.margins.registry``
names the types. From those declarations come ``build_margin``'s defaults, its errors
(:func:`key_errors`) and ``trainer.config``'s ``margin:`` schema, so a default or a bound is
written once. Rules that tie several keys together are a ``errors()`` method of the dataclass.
Each error is (dotted config key, one line naming key, value and the valid range).
Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["MAX_SCALE", "AdaCosMode", "Bounds", "Error", "MarginGradient", "MarginSpec",
           "SharedConfig", "bounds_of", "error", "key", "key_errors", "raise_errors"]

Error = tuple[str, str]  # (dotted config key, message)


@dataclass(frozen=True)
class Bounds:
    """The range of a numeric key: ``ge``/``gt``/``le``/``lt`` (None = open); ``integer``:
    only whole numbers (SphereFace's ``m``)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    integer: bool = False

    def holds(self, v: float) -> bool:
        return (math.isfinite(v) and (not self.integer or float(v).is_integer())
                and (self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))

    def rule(self, v: float, need: str = "must be") -> str | None:
        """What ``v`` breaks (``must be a finite number >= 0 and <= 1``), or None; ``need``:
        the words before the range (``sphereface needs``)."""
        return None if self.holds(v) else f"{need} {self.text()}"

    def text(self) -> str:
        parts = [f"{sym} {_num(v)}" for sym, v in ((">=", self.ge), (">", self.gt),
                                                  ("<=", self.le), ("<", self.lt))
                 if v is not None]
        return ("an integer " if self.integer else "a finite number ") + " and ".join(parts)


def _num(v: float) -> str:
    return "pi" if v == math.pi else f"{v:g}"


def key(default: Any, description: str, **bounds: Any) -> Any:
    """A config key of a margin's dataclass: its default, its one-line description (what the
    ``--help`` reference prints) and, for a number, its :class:`Bounds`."""
    return dataclasses.field(default=default, metadata={"description": description,
                                                        "bounds": Bounds(**bounds)})


@dataclass(frozen=True)
class MarginSpec:
    """One ``margin.type``: its ``name``, the dataclass of its own keys (``config``),
    ``build(config, scale, warmup_steps) -> Margin``, ``psi`` (the target transform in one
    line, for the docs) and ``paper`` (arXiv id and equations, or the code it follows)."""

    name: str
    config: type
    build: Callable[..., Any]
    psi: str
    paper: str


def bounds_of(config: type, name: str) -> Bounds:
    """The :class:`Bounds` key ``name`` of dataclass ``config`` declares."""
    return next(f.metadata["bounds"] for f in dataclasses.fields(config) if f.name == name)


def error(key_name: str, value: Any, rule: str) -> Error:
    return f"margin.{key_name}", f"margin.{key_name}={value!r}: {rule}"


def raise_errors(errors: list[Error]) -> None:
    """Raise one ``ValueError`` joining every message of ``errors``, if any."""
    if errors:
        raise ValueError("; ".join(msg for _, msg in errors))


def _value_error(name: str, value: Any, kind: Any, bounds: Bounds, need: str) -> Error | None:
    """The error of one value against its field's type and bounds, or None."""
    if typing.get_origin(kind) is Literal or kind is type(None):
        return None  # checked by the caller (choices)
    if kind is bool:
        return None if isinstance(value, bool) else error(name, value, f"{need} true or false")
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and (kind is float or float(value).is_integer()):
        broken = bounds.rule(value, need)
        return None if broken is None else error(name, value, broken)
    return error(name, value, f"{need} {bounds.text()}".rstrip())


def key_errors(config: type, values: Mapping[str, Any], owner: str | None = None) -> list[Error]:
    """Every declared type or bound of dataclass ``config`` that ``values`` (a subset of its
    fields, None meaning absent) breaks; ``owner``: the margin type the keys are of, named in
    the message (None: keys of every type)."""
    need = "must be" if owner is None else f"{owner} needs"
    hints = typing.get_type_hints(config)
    out = []
    for f in dataclasses.fields(config):
        value = values.get(f.name)
        if value is None:
            continue
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) is Literal or (args and typing.get_origin(args[0]) is Literal):
            choices = typing.get_args(kind if typing.get_origin(kind) is Literal else args[0])
            if value not in choices:
                out.append(error(f.name, value, f"not one of {'|'.join(map(str, choices))}"))
            continue
        found = _value_error(f.name, value, args[0] if args else kind, f.metadata["bounds"],
                             need)
        if found:
            out.append(found)
    return out


AdaCosMode = Literal["fixed", "dynamic"]
MarginGradient = Literal["exact", "straight_through"]
MAX_SCALE = 1024.0  # s*cos are the logits: past ~1e3 the softmax is a hard max (fp32 loses m)


@dataclass(frozen=True)
class SharedConfig:
    """The keys every ``margin.type`` takes (besides ``type``)."""

    s: float = key(64.0, "fixed logit scale (ignored when margin.adacos is set); the published "
                   "recipes use 30-64", gt=0, le=MAX_SCALE)
    adacos: AdaCosMode | None = key(None, "AdaCos scale (arXiv:1905.00292) instead of "
                                    "margin.s: fixed or dynamic; required for type=adacos, "
                                    "combinable with any type")
    warmup_steps: int = key(0, "any type: the margin's penalty ramps linearly from 0 (plain "
                            "cosine) to its full value over this many training steps (eases "
                            "ArcFace on ViTs); 0 = none", ge=0, integer=True)
    gradient: MarginGradient = key("exact", "exact: the margin's true derivative; "
                                   "straight_through: forward unchanged, d psi/d cos = 1 "
                                   "(insightface arcface_torch's gradient, which its published "
                                   "ArcFace numbers used)")
    interclass_filter: float = key(0.0, "any type: non-target cosines above this are zeroed "
                                   "(arcface_torch's interclass_filtering_threshold); 0 = off",
                                   ge=0, lt=1)
    subcenters: int = key(1, "sub-center ArcFace (Deng et al., ECCV 2020): K centres per "
                          "class, a class's cosine the largest of its K, with any margin type; "
                          "1 = off, the paper's K is 3; the head holds K x the rows (launch.plan "
                          "counts them); launch.clean lists the samples far from their class's "
                          "dominant centre", ge=1, integer=True)
