"""The margin registry: every ``margin.type``, and what is derived from it.

``REGISTRY`` maps each type to its :class:`MarginSpec` (declared in its family's file). From
it come :func:`build_margin`, :func:`margin_errors` (the rules ``trainer.config`` reports
before any process starts), :func:`effective` (a config with the type's defaults filled) and
:func:`schema_keys`, the union of every type's keys that ``trainer.config``'s ``margin:``
section is generated from. A key several types declare with different defaults (``m``)
defaults to None there: "the type's default".
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

__all__ = ["DEFAULT_TYPE", "MARGIN_KEYS", "MARGIN_TYPES", "REGISTRY", "MarginType", "SchemaKey",
           "build_margin", "effective", "margin_errors", "margin_warnings",
           "normface_scale_bound", "schema_keys"]

REGISTRY: dict[str, MarginSpec] = {spec.name: spec for spec in (
    NORMFACE, SPHEREFACE, COSFACE, ARCFACE, COMBINED, ADACOS, ADAFACE, CURRICULARFACE, MAGFACE,
    *ELASTIC_SPECS,
)}
MARGIN_TYPES: tuple[str, ...] = tuple(REGISTRY)
MarginType = Literal[MARGIN_TYPES]  # type: ignore[valid-type]
DEFAULT_TYPE = "arcface"
TYPE_DESCRIPTION = ("target-logit transform (partial_fc.margins; docs/margins.md): "
                    + ", ".join(MARGIN_TYPES))
_SHARED = tuple(f.name for f in dataclasses.fields(SharedConfig))
# The keys build_margin reads: type, the shared ones and every type's own.
MARGIN_KEYS = frozenset({"type", *_SHARED, *(f.name for spec in REGISTRY.values()
                                              for f in dataclasses.fields(spec.config))})


def _given(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if v is not None}


def _own(spec: MarginSpec, given: Mapping[str, Any]) -> dict[str, Any]:
    return {f.name: given[f.name] for f in dataclasses.fields(spec.config) if f.name in given}


def margin_errors(cfg: Mapping[str, Any]) -> list[Error]:
    """Every rule the margin config ``cfg`` (``build_margin``'s keys) breaks, as
    ``(dotted key, message)``; empty when ``build_margin(cfg)`` will succeed. A key whose
    value is None counts as absent; keys of other types are not read."""
    unknown = sorted(set(cfg) - MARGIN_KEYS)
    if unknown:
        return [("margin", f"margin: unknown key(s) {unknown}; valid keys: {sorted(MARGIN_KEYS)}")]
    given = _given(cfg)
    out = key_errors(SharedConfig, given)
    kind = given.get("type")
    if kind not in REGISTRY:
        return [*out, error("type", kind, f"not one of {'|'.join(MARGIN_TYPES)}")]
    if kind == "adacos" and given.get("adacos") is None:
        out.append(error("adacos", None, "type=adacos needs adacos=fixed|dynamic"))
    spec = REGISTRY[kind]
    own = _own(spec, given)
    found = key_errors(spec.config, own, kind)
    if not found and hasattr(spec.config, "errors"):
        found = spec.config(**own).errors()
    return out + found


def effective(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` as its type reads it: ``type``, the shared keys and the type's own, each the
    given value or the default (keys of other types dropped). ``cfg`` must be valid."""
    given = _given(cfg)
    spec = REGISTRY[given["type"]]
    shared = dataclasses.asdict(SharedConfig(**{k: given[k] for k in _SHARED if k in given}))
    return {"type": spec.name, **shared, **dataclasses.asdict(spec.config(**_own(spec, given)))}


def build_margin(cfg: Mapping[str, Any]) -> Margin:
    """Build a margin from a config dict: ``type`` (a name of ``REGISTRY``), the shared keys
    (``partial_fc.margins.keys.SharedConfig``: ``s``, ``adacos`` (required for
    ``type=adacos``, combinable with any type; when set, ``s`` is ignored), ``warmup_steps``
    (the margin ramps in, see :class:`Margin`), ``gradient``, ``interclass_filter``,
    ``subcenters`` (read by ``PartialFC``)) and the type's own keys (its family's file). A
    key whose value is None counts as absent (its default); keys of other types are ignored,
    so one flat schema can pass them all. Bad keys or values raise one ``ValueError`` naming
    each (:func:`margin_errors`).
    """
    raise_errors(margin_errors(cfg))
    full = effective(cfg)
    spec = REGISTRY[full["type"]]
    adacos = full["adacos"]
    scale = AdaCosScale(adacos == "dynamic") if adacos else FixedScale(float(full["s"]))
    own = spec.config(**{f.name: full[f.name] for f in dataclasses.fields(spec.config)})
    margin = spec.build(own, scale, full["warmup_steps"])
    margin.gradient = full["gradient"]
    margin.interclass_filter = full["interclass_filter"] or None
    return margin


@dataclass(frozen=True)
class SchemaKey:
    """One key of the flat ``margin:`` schema: its annotation, default (None: the type's),
    bounds (None where the declaring types disagree; ``margin_errors`` checks them) and
    description."""

    name: str
    annotation: Any
    default: Any
    bounds: Bounds | None
    description: str


def merge_key(name: str, fields: list[tuple[str, dataclasses.Field, Any]]) -> SchemaKey:
    """The schema key ``name`` from every type's declaration ``(type, field, annotation)``."""
    kinds = {str(ann) for _, _, ann in fields}
    if len(kinds) != 1:
        raise TypeError(f"margin key {name!r} is declared with several types: {sorted(kinds)}")
    defaults = {repr(f.default) for _, f, _ in fields}
    bounds = {f.metadata["bounds"] for _, f, _ in fields}
    ann = fields[0][2]
    one = len(defaults) == 1
    groups: dict[tuple[str, str], list[str]] = {}
    for kind, f, _ in fields:
        groups.setdefault((f.metadata["description"], repr(f.default)), []).append(kind)
    parts = [f"{'/'.join(types)}: {text}" + ("" if one else f" ({_shown(default)})")
             for (text, default), types in groups.items()]
    if not one:
        parts.append("null = the type's default")
    return SchemaKey(name, ann if one else ann | None, fields[0][1].default if one else None,
                     bounds.pop() if len(bounds) == 1 else None, "; ".join(parts))


def _shown(default_repr: str) -> str:
    return {"True": "true", "False": "false"}.get(default_repr, default_repr.strip("'"))


def schema_keys() -> list[SchemaKey]:
    """The ``margin:`` section's keys: ``type``, the shared keys, then each type's own in
    registry order, merged where several types declare one."""
    out = [SchemaKey("type", MarginType, DEFAULT_TYPE, None, TYPE_DESCRIPTION)]
    hints = typing.get_type_hints(SharedConfig)
    out += [SchemaKey(f.name, hints[f.name], f.default, f.metadata["bounds"],
                      f.metadata["description"]) for f in dataclasses.fields(SharedConfig)]
    declared: dict[str, list[tuple[str, dataclasses.Field, Any]]] = {}
    for spec in REGISTRY.values():
        hints = typing.get_type_hints(spec.config)
        for f in dataclasses.fields(spec.config):
            declared.setdefault(f.name, []).append((spec.name, f, hints[f.name]))
    return out + [merge_key(name, fields) for name, fields in declared.items()]


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
