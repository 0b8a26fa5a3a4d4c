"""The margin registry: every ``margin.type``, and what is derived from it.

``REGISTRY`` maps each type to its :class:`MarginSpec` (declared in its family's file). From
it come :func:`build_margin`, :func:`margin_errors` (the rules ``trainer.config`` reports
before any process starts), :func:`effective` (a config with the type's defaults filled),
:func:`schema_keys`, one type's keys that ``trainer.config``'s ``margin:`` section (a union
discriminated by ``type``) is generated from, and :func:`foreign_key_error`, the one line a
key of another type gets.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from partial_fc.margins.adaface import ADAFACE
from partial_fc.margins.base import Margin
from partial_fc.margins.combined import ADACOS, ARCFACE, COMBINED, COSFACE, NORMFACE
from partial_fc.margins.curricularface import CURRICULARFACE
from partial_fc.margins.elasticface import ELASTIC_SPECS
from partial_fc.margins.keys import (
    Bounds,
    Error,
    MarginSpec,
    SharedConfig,
    error,
    key_errors,
    raise_errors,
)
from partial_fc.margins.magface import MAGFACE
from partial_fc.margins.sphereface import SPHEREFACE
from partial_fc.scale import AdaCosScale, FixedScale

__all__ = ["DEFAULT_TYPE", "MARGIN_TYPES", "REGISTRY", "SHARED_KEYS", "SchemaKey",
           "build_margin", "effective", "foreign_key_error", "margin_errors", "margin_warnings",
           "normface_scale_bound", "own_keys", "read_keys", "schema_keys"]

REGISTRY: dict[str, MarginSpec] = {spec.name: spec for spec in (
    NORMFACE, SPHEREFACE, COSFACE, ARCFACE, COMBINED, ADACOS, ADAFACE, CURRICULARFACE, MAGFACE,
    *ELASTIC_SPECS,
)}
MARGIN_TYPES: tuple[str, ...] = tuple(REGISTRY)
DEFAULT_TYPE = "arcface"
TYPE_DESCRIPTION = ("target-logit transform (partial_fc.margins; docs/margins.md): "
                    + ", ".join(MARGIN_TYPES) + "; it picks the keys below that are read")
SHARED_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SharedConfig))


def own_keys(kind: str) -> tuple[str, ...]:
    """The keys of type ``kind`` itself (its config dataclass's fields), in declared order."""
    return tuple(f.name for f in dataclasses.fields(REGISTRY[kind].config))


def read_keys(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` less the keys its type does not read (a config written when one flat section
    held every type's keys, as a checkpoint from then holds it); ``cfg`` itself when its type
    is not registered."""
    kind = cfg.get("type", DEFAULT_TYPE)
    if kind not in REGISTRY:
        return dict(cfg)
    keep = {"type", *SHARED_KEYS, *own_keys(kind)}
    return {k: v for k, v in cfg.items() if k in keep}


def foreign_key_error(kind: str, name: str, value: Any) -> Error | None:
    """The error of key ``name`` given to ``margin.type=kind``, which does not read it, when
    another type does (None when no type does: an unknown key, which the caller names)."""
    owners = [t for t in MARGIN_TYPES if name in own_keys(t)]
    if not owners:
        return None
    mine = ", ".join(own_keys(kind)) or "none"
    return error(name, value, f"only read by margin.type={'|'.join(owners)} ({kind}'s own "
                              f"keys: {mine})")


def _given(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if v is not None}


def _own(spec: MarginSpec, given: Mapping[str, Any]) -> dict[str, Any]:
    return {f.name: given[f.name] for f in dataclasses.fields(spec.config) if f.name in given}


def margin_errors(cfg: Mapping[str, Any]) -> list[Error]:
    """Every rule the margin config ``cfg`` (``build_margin``'s keys) breaks, as
    ``(dotted key, message)``; empty when ``build_margin(cfg)`` will succeed. A key whose
    value is None counts as absent; a key of another type is refused
    (:func:`foreign_key_error`)."""
    given = _given(cfg)
    kind = given.get("type", DEFAULT_TYPE)
    if kind not in REGISTRY:
        return [error("type", kind, f"not one of {'|'.join(MARGIN_TYPES)}")]
    spec, valid = REGISTRY[kind], {"type", *SHARED_KEYS, *own_keys(kind)}
    unknown = sorted(k for k in cfg if k not in valid and not foreign_key_error(kind, k, None))
    if unknown:
        return [("margin", f"margin: unknown key(s) {unknown}; margin.type={kind} reads "
                 f"{sorted(valid)}")]
    out = [foreign_key_error(kind, k, v) for k, v in given.items() if k not in valid]
    out += key_errors(SharedConfig, given)
    if kind == "adacos" and given.get("adacos") is None:
        out.append(error("adacos", None, "type=adacos needs adacos=fixed|dynamic"))
    own = _own(spec, given)
    found = key_errors(spec.config, own, kind)
    if not found and hasattr(spec.config, "errors"):
        found = spec.config(**own).errors()
    return out + found


def effective(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` as its type reads it: ``type``, the shared keys and the type's own, each the
    given value or the default. ``cfg`` must be valid."""
    given = _given(cfg)
    spec = REGISTRY[given.get("type", DEFAULT_TYPE)]
    shared = dataclasses.asdict(SharedConfig(**{k: given[k] for k in SHARED_KEYS if k in given}))
    return {"type": spec.name, **shared, **dataclasses.asdict(spec.config(**_own(spec, given)))}


def build_margin(cfg: Mapping[str, Any]) -> Margin:
    """Build a margin from a config dict: ``type`` (a name of ``REGISTRY``; default
    ``DEFAULT_TYPE``), the shared keys (``partial_fc.margins.keys.SharedConfig``: ``s``,
    ``adacos`` (required for ``type=adacos``, combinable with any type; when set, ``s`` is
    ignored), ``warmup_steps`` (the margin ramps in, see :class:`Margin`), ``gradient``,
    ``interclass_filter``, ``subcenters`` (read by ``PartialFC``)) and the type's own keys
    (its family's file). A key whose value is None counts as absent (its default). Bad keys
    or values, a key of another type among them, raise one ``ValueError`` naming each
    (:func:`margin_errors`).
    """
    raise_errors(margin_errors(cfg))
    full = effective(cfg)
    spec = REGISTRY[full["type"]]
    adacos = full["adacos"]
    scale = AdaCosScale(adacos == "dynamic") if adacos else FixedScale(float(full["s"]))
    own = spec.config(**{name: full[name] for name in own_keys(spec.name)})
    margin = spec.build(own, scale, full["warmup_steps"])
    margin.gradient = full["gradient"]
    margin.interclass_filter = full["interclass_filter"] or None
    return margin


@dataclass(frozen=True)
class SchemaKey:
    """One key of a type's ``margin:`` schema: its annotation, default, bounds and
    description, as its dataclass declares them."""

    name: str
    annotation: Any
    default: Any
    bounds: Bounds | None
    description: str


def _declared(config: type) -> list[SchemaKey]:
    hints = typing.get_type_hints(config)
    return [SchemaKey(f.name, hints[f.name], f.default, f.metadata["bounds"],
                      f.metadata["description"]) for f in dataclasses.fields(config)]


def schema_keys(kind: str) -> list[SchemaKey]:
    """The ``margin:`` section of ``margin.type=kind``: ``type`` (that one name), the shared
    keys, then the type's own."""
    return [SchemaKey("type", Literal[kind], kind, None, TYPE_DESCRIPTION),
            *_declared(SharedConfig), *_declared(REGISTRY[kind].config)]


def normface_scale_bound(num_classes: int, p_w: float) -> float:
    """Smallest fixed scale s for which the softmax can reach target probability ``p_w``.

    NormFace (arXiv:1704.06369, Prop. 2) / CosFace (arXiv:1801.09414, Sec. 3.4, Eq. 9):
    ``s >= (C - 1) / C * ln((C - 1) * P_W / (1 - P_W))``.
    """
    c = num_classes
    return (c - 1) / c * math.log((c - 1) * p_w / (1 - p_w))


def margin_warnings(cfg: Mapping[str, Any], num_classes: int, p_w: float) -> list[str]:
    """Settings that train but contradict the theory for ``num_classes`` classes, one line
    each: a fixed scale below the NormFace/CosFace bound at target probability ``p_w``, a
    CosFace margin outside ``[0, C/(C-1)]``. Empty for ``C < 2``; ``cfg`` must be valid."""
    c = num_classes
    if c < 2:
        return []
    full = effective(cfg)
    kind, s = full["type"], full["s"]
    out = []
    if kind not in ("sphereface", "adacos") and full["adacos"] is None:  # a fixed scale
        bound = normface_scale_bound(c, p_w)
        if s < bound:
            out.append(
                f"margin.s={s} is below the NormFace/CosFace bound {bound:.2f} for C={c} "
                f"classes at P_W={p_w}: the loss cannot reach P_W (arXiv:1801.09414 Eq. 9)"
            )
    if kind == "cosface" and not 0 <= full["m"] <= c / (c - 1):
        out.append(
            f"margin.m={full['m']} is outside the CosFace range [0, C/(C-1)] = "
            f"[0, {c / (c - 1):.4f}] for C={c} (arXiv:1801.09414 Sec. 3.4)"
        )
    return out
