"""The key reference ``python -m launch.train --help`` prints, generated from the schema:
every key with its type, bounds, default and description, so it cannot drift from them."""

from __future__ import annotations

import math
import typing
from typing import Annotated, Any, Literal

import yaml
from pydantic import Tag

from trainer.config.schema import Config
from trainer.config.sections.base import Section


def describe_keys(width: int = 92) -> str:
    """Every config key with its type, default and description, grouped by section (the
    margin's: the keys every type reads, then each type's own): the reference
    ``python -m launch.train --help`` prints, generated from the schema."""
    lines: list[str] = []
    top = Config.model_fields
    for name, field in top.items():
        if _section_model(field.annotation) is None and not tagged_sections(field.annotation):
            lines += _describe(name, field, width)
    for name, field in top.items():
        section = _section_model(field.annotation)
        if section is not None:
            lines += ["", f"{name}: {field.description}"]
            for key, sub in section.model_fields.items():
                lines += _describe(f"{name}.{key}", sub, width)
        elif members := tagged_sections(field.annotation):
            lines += ["", f"{name}: {field.description}", *_describe_union(name, field, members,
                                                                           width)]
    return "\n".join(lines)


def _describe_union(name: str, field: Any, members: dict[str, type[Section]],
                    width: int) -> list[str]:
    """A section whose ``type`` key picks its model (``margin``): the choices, the keys every
    model holds, then each model's own under ``name.type=TAG:``."""
    first = type(field.get_default(call_default_factory=True)).model_fields
    common = [k for k in first
              if k != "type" and all(k in m.model_fields for m in members.values())]
    lines = _describe(f"{name}.type", first["type"], width, Literal[tuple(members)])
    for key in common:
        lines += _describe(f"{name}.{key}", first[key], width)
    for kind, model in members.items():
        own = [k for k in model.model_fields if k != "type" and k not in common]
        lines.append(f"  {name}.type={kind}:" + ("" if own else " no keys of its own"))
        for key in own:
            lines += ["  " + line for line in _describe(f"{name}.{key}", model.model_fields[key],
                                                         width - 2)]
    return lines


def _section_model(annotation: Any) -> type[Section] | None:
    """The section model a top-level key holds, or None for a plain key (name, seed, ...)."""
    return annotation if isinstance(annotation, type) and issubclass(annotation, Section) else None


def tagged_sections(annotation: Any) -> dict[str, type[Section]]:
    """The models of a section that is a union discriminated by a tag (``margin``), by tag;
    empty for any other annotation."""
    out = {}
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is Annotated:
            model, *meta = typing.get_args(arg)
            tags = [m.tag for m in meta if isinstance(m, Tag)]
            if tags and _section_model(model):
                out[tags[0]] = model
    return out


def _describe(key: str, field: Any, width: int, annotation: Any = None) -> list[str]:
    """``key``'s line (type, bounds, default) and its description; ``annotation``: shown
    instead of the field's."""
    import textwrap

    kind = _type_name(annotation or field.annotation) + _bounds(field.metadata)
    head = f"  {key}: {kind} = {_yaml_value(field.get_default(call_default_factory=True))}"
    return [head, *textwrap.wrap(field.description, width, initial_indent=" " * 6,
                                 subsequent_indent=" " * 6)]


def _yaml_value(value: Any) -> str:
    """``value`` as it would be written in a recipe (``null``, ``true``, ``[0.9, 0.999]``)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1000)
    return text.removesuffix("\n...\n").strip()


def _type_name(annotation: Any) -> str:
    import types
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0]) + _bounds(args[1:])
    if origin is Literal:
        return "|".join(_yaml_value(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        named = [_type_name(a) for a in args if a is not type(None)]
        return " | ".join(named) + (" | null" if type(None) in args else "")
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(metadata: Any) -> str:
    """``gt=0`` as `` > 0`` and so on (constraints sit in FieldInfo.metadata or directly)."""
    symbols = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    parts = []
    for item in metadata:
        for bound in getattr(item, "metadata", [item]):
            for attr, symbol in symbols.items():
                if getattr(bound, attr, None) is not None:
                    value = getattr(bound, attr)
                    parts.append(f"{symbol} {'pi' if value == math.pi else value}")
            if getattr(bound, "min_length", None) is not None:  # betas: min == max
                parts.append(f"length {bound.min_length}")
    return f" ({', '.join(parts)})" if parts else ""
