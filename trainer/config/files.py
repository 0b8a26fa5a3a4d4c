"""Reading YAML recipes: the ``base:`` chain, ``key=value`` overrides, where each key was set.

A recipe names its parent with ``base: base.yaml`` (resolved relative to the recipe's own
folder, chains allowed); mappings merge key by key, everything else (lists included)
replaces. Command-line overrides are ``dotted.key=value`` with the value parsed as YAML
(``margin.type=cosface optim.lr=0.05 eval.bins=[a.bin,b.bin]``). A key repeated in one file
is refused rather than silently overwritten.

Kept apart from the schema because its job is provenance: ``origin`` records the file (or
``command line``) that set each dotted key, so that every error :func:`trainer.config.load_config`
reports, schema errors included (:func:`schema_errors`), names the file to edit.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from partial_fc.margins.keys import SharedConfig
from partial_fc.margins.registry import (
    DEFAULT_TYPE,
    MARGIN_TYPES,
    REGISTRY,
    effective,
    foreign_key_error,
    margin_errors,
)
from trainer.config.reference import tagged_sections
from trainer.config.schema import Config, ConfigError
from trainer.config.sections.loss import MARGIN_MODELS
from trainer.yaml_file import YamlRefused, parse_yaml, read_yaml, shown_value

CLI = "command line"
# The margin keys that stay when the command line changes margin.type: those of every type
# except s, which recipes tune with their margin (smoke.yaml: CosFace at s=30).
KEPT_ON_RETYPE = frozenset(f.name for f in dataclasses.fields(SharedConfig)) - {"s"} | {"p_w"}



def parse_value(text: str, source: str = CLI) -> Any:
    """Parse one override value the way YAML would (``0.1`` float, ``[a,b]`` list);
    :class:`YamlRefused` naming ``source`` when it is malformed or exceeds a bound."""
    return parse_yaml(text, source)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = read_yaml(path, shown(path))
    except YamlRefused as e:
        raise ConfigError(str(e)) from None
    if data is None:  # every key at its default: iresnet50 at batch 128, minutes a step on a CPU
        raise ConfigError(f"{shown(path)}: empty config: start from configs/smoke.yaml or a "
                          "recipe (configs/*.yaml)")
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError(f"{shown(path)}: top level must be a mapping, got {kind}")
    return data


def _merge(dst: dict, src: dict, source: str, origin: dict[str, str], prefix: str = "") -> None:
    """Deep-merge ``src`` into ``dst``, recording in ``origin`` where each key came from."""
    for key, value in src.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(dst.get(key, {}), dict):
            _merge(dst.setdefault(key, {}), value, source, origin, dotted + ".")
        else:
            dst[key] = value
            for k in [k for k in origin if k.startswith(dotted + ".")]:
                del origin[k]
            origin[dotted] = source


def load_tree(path: Path, origin: dict[str, str], chain: tuple[Path, ...] = ()) -> dict:
    """The merged tree of ``path`` and its ``base:`` ancestors (``chain``: the files below
    it, to refuse a cycle); fills ``origin`` with the file that set each dotted key."""
    path = path.resolve()
    if path in chain:
        raise ConfigError(f"{shown(chain[-1])}: base: cycle through {shown(path)}")
    data = _read_yaml(path)
    tree: dict[str, Any] = {}
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{shown(path)}: base={shown_value(base)}: must be a file name")
        base_path = path.parent / base
        if not os.path.isfile(base_path):  # False for a name too long, where is_file raises
            raise ConfigError(f"{shown(path)}: base={shown_value(base)}: no such file (read "
                              f"from {shown(path.parent)})")
        tree = load_tree(base_path, origin, (*chain, path))
    _merge(tree, data, shown(path), origin)
    return tree


def shown(path: Path) -> str:
    """``path`` relative to the working folder when it lies inside it (shorter messages)."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# Keys that replace each other: an override of one drops the other where a file set it, so
# a run folder's config.yaml (which names data.dir) trains on data.dirs given after it.
ALTERNATIVES = {"data.dir": "data.dirs", "data.dirs": "data.dir"}


def apply_overrides(tree: dict, overrides: list[str], origin: dict[str, str]) -> list[str]:
    """Merge each ``dotted.key=value`` into ``tree`` (origin: ``command line``); returns one
    error line per malformed override instead of raising, so they join the full report.

    ``key=null`` for a key that cannot be null removes what the files set: the key takes the
    schema's default (the way back for a key a run folder's config.yaml spells out)."""
    errors = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            errors.append(f"{CLI}: {shown_value(item)}: overrides are dotted.key=value")
            continue
        try:
            value = parse_value(text, f"{CLI}: {key}={shown_value(text)}")
        except YamlRefused as e:
            errors.append(str(e))
            continue
        if key in ALTERNATIVES and origin.get(ALTERNATIVES[key], CLI) != CLI:
            _remove(tree, ALTERNATIVES[key], origin)
        if value is None and not _nullable(key):
            _remove(tree, key, origin)
            continue
        nested: dict[str, Any] = value
        for part in reversed(key.split(".")):
            nested = {part: nested}
        _merge(tree, nested, CLI, origin)
    return errors


def margin_type(tree: dict) -> Any:
    """The ``margin.type`` of a merged tree (the schema's default when none is set)."""
    margin = tree.get("margin")
    return margin.get("type", DEFAULT_TYPE) if isinstance(margin, dict) else None


def retype_margin(tree: dict, origin: dict[str, str], recipe_type: Any) -> str | None:
    """When the command line set ``margin.type`` to another type than the recipe's
    (``recipe_type``), drop the margin keys the recipe files set for their type (all but
    ``KEPT_ON_RETYPE`` and those the command line set too), so that the new type takes its
    own defaults; return the one line that says so (None when nothing changed)."""
    margin = tree.get("margin")
    if not isinstance(margin, dict) or origin.get("margin.type") != CLI:
        return None
    new = margin.get("type")
    if new == recipe_type or new not in REGISTRY:
        return None
    dropped = {k: v for k, v in margin.items()
               if k not in KEPT_ON_RETYPE | {"type"} and origin.get(f"margin.{k}") != CLI}
    read = effective({"type": new})
    changed = [k for k, v in dropped.items() if k in read and v != read[k]]
    files = sorted({origin.get(f"margin.{k}", "the recipe") for k in changed})
    for k in dropped:
        del margin[k]
        origin.pop(f"margin.{k}", None)
    if not changed:
        return None
    shown_keys = ", ".join(f"margin.{k} {shown_value(dropped[k])} -> {read[k]!r}" for k in changed)
    return (f"margin.type={new} (command line) replaces {recipe_type} ({', '.join(files)}): "
            f"{shown_keys}, {new}'s defaults; give a key on the command line to keep it")


def _nullable(dotted: str) -> bool:
    """Whether the schema's ``dotted`` key takes null (an unknown key: yes, so that the
    schema names it; a margin key: where any type that reads it takes null)."""
    *parents, leaf = dotted.split(".")
    _, holders = _holders((*parents, leaf), tagged=False)
    fields = [m.model_fields[leaf] for m in holders if leaf in m.model_fields]
    return not fields or any(type(None) in typing.get_args(f.annotation) for f in fields)


def _remove(tree: dict, dotted: str, origin: dict[str, str]) -> None:
    """Drop ``dotted`` (and what was under it) from ``tree`` and ``origin``."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.get(part) if isinstance(tree, dict) else None
    if isinstance(tree, dict):
        tree.pop(leaf, None)
    for k in [k for k in origin if k == dotted or k.startswith(dotted + ".")]:
        del origin[k]


# ----------------------------------------------------------------------------- schema errors


def source_of(origin: dict[str, str], dotted: str, default: str) -> str:
    """The file that set ``dotted`` or its nearest parent (a whole section replaced), else
    ``default`` (load_config passes the recipe it was given)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in origin:
            return origin[".".join(parts[:i])]
    return default


def _holders(loc: tuple[str, ...], tagged: bool) -> tuple[tuple[str, ...], list[type[BaseModel]]]:
    """``loc`` as the user writes it, and the models that may hold its last key. In a
    pydantic error's loc (``tagged``) the margin section's type follows ``margin``
    (``margin.cosface.m``) and picks its model; a user's key holds no tag: every type's model
    may hold it."""
    keys: list[str] = []
    models: list[type[BaseModel]] = [Config]
    holders: list[type[BaseModel]] = []
    rest = list(loc)
    while rest:
        part, holders, models = rest.pop(0), models, []
        keys.append(part)
        for model in holders:
            field = model.model_fields.get(part)
            ann = field.annotation if field else None
            members = tagged_sections(ann)
            if members and tagged and rest:
                models.append(members[rest.pop(0)])
            elif members:
                models += members.values()
            elif isinstance(ann, type) and issubclass(ann, BaseModel):
                models.append(ann)
    return tuple(keys), holders


def _margin_type(model: type[BaseModel]) -> str | None:
    """The margin type whose section ``model`` is, or None."""
    return next((kind for kind, m in MARGIN_MODELS.items() if m is model), None)


def schema_errors(err: ValidationError, origin: dict[str, str], top: str) -> list[str]:
    """pydantic's errors as report lines, each naming the file that set the key; an unknown
    key lists the valid keys of its section, a margin key of another type names the types
    that read it."""
    lines = []
    for e in err.errors():
        keys, holders = _holders(tuple(_cut(str(p)) for p in e["loc"]), tagged=True)
        dotted = ".".join(keys)
        src = source_of(origin, dotted, top)
        if e["type"] == "union_tag_invalid":  # the margin section's type: the registry's rule
            value = e["input"].get("type")
            tag = value if isinstance(value, str) and len(value) <= 60 else shown_value(value)
            ((key, msg),) = margin_errors({"type": tag})
            near = difflib.get_close_matches(tag, MARGIN_TYPES, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            lines.append(f"{source_of(origin, key, top)}: {msg}{hint}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"{src}: {_extra_key(keys, holders[0] if holders else None, e)}")
        else:
            value = e.get("input")
            given = "<missing>" if e["type"] == "missing" else shown_value(value)
            # A rule partial_fc states (a validator's ValueError): its own words, not pydantic's
            # "Value error, " before them.
            msg = str(e["ctx"]["error"]) if e["type"] == "value_error" else e["msg"]
            lines.append(f"{src}: {dotted}={given}: {msg}{_hint(e, keys, holders)}")
    return lines


def _cut(key: str) -> str:
    """A key as a message shows it: a key longer than any the schema holds, cut."""
    return key if len(key) <= 60 else f"{key[:40]}...({len(key)} characters)"


def _extra_key(keys: tuple[str, ...], parent: type[BaseModel] | None, error: dict) -> str:
    """The line of a key its section does not hold: a margin key of another type names the
    types that read it (the registry's rule); any other, the section's keys."""
    kind = _margin_type(parent) if parent else None
    foreign = foreign_key_error(kind, keys[-1], error["input"]) if kind else None
    if foreign:
        return foreign[1]
    known = list(parent.model_fields) if parent else []
    near = difflib.get_close_matches(keys[-1], known, n=1)
    hint = f"did you mean {'.'.join((*keys[:-1], near[0]))}? " if near else ""
    return f"{'.'.join(keys)}: unknown key ({hint}valid keys: {', '.join(known) or 'none'})"


def _hint(error: dict, keys: tuple[str, ...], holders: list[type[BaseModel]]) -> str:
    """What follows pydantic's message: the nearest choice of a mistyped enum value, or an
    example of the type a value did not parse as (the key's default)."""
    value = error.get("input")
    if error["type"] == "literal_error" and isinstance(value, str):
        choices = re.findall(r"'([^']*)'", str(error.get("ctx", {}).get("expected", "")))
        near = difflib.get_close_matches(value, choices, n=1)
        return f" (did you mean {near[0]!r}?)" if near else ""
    if not error["type"].endswith(("_parsing", "_type")):
        return ""
    field = holders[0].model_fields.get(keys[-1]) if holders else None
    default = field.get_default(call_default_factory=True) if field else None
    if default is None or default == [] or isinstance(default, BaseModel):
        return ""
    shown_default = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...")
    return f" (e.g. {'.'.join(keys)}={shown_default.strip()})"
