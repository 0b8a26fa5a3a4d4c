"""The margin registry: every type is documented, and a declared key cannot be declared twice
with different types (the flat config schema merges them)."""

import dataclasses
import re
from pathlib import Path

import pytest

from partial_fc.margins.keys import MarginSpec, key
from partial_fc.margins.registry import REGISTRY, merge_key, schema_keys

DOCS = Path(__file__).resolve().parents[2] / "docs" / "margins.md"


def test_docs_margins_table_has_a_row_for_every_type():
    rows = [line.split("|")[1] for line in DOCS.read_text().splitlines()
            if line.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`([a-z_]+)`", row)}
    assert set(REGISTRY) <= named, sorted(set(REGISTRY) - named)


def test_every_type_builds_from_its_declared_defaults():
    for name, spec in REGISTRY.items():
        assert isinstance(spec, MarginSpec) and spec.name == name
        config = spec.config()
        assert dataclasses.is_dataclass(config)
        assert not getattr(config, "errors", lambda: [])(), name
    assert {k.name for k in schema_keys()} >= {"type", "s", "m", "sigma", "elastic_sort"}


def test_a_key_declared_with_two_types_is_refused():
    @dataclasses.dataclass(frozen=True)
    class A:
        x: float = key(1.0, "a number")

    @dataclasses.dataclass(frozen=True)
    class B:
        x: bool = key(True, "a switch")

    fields = [("a", dataclasses.fields(A)[0], float), ("b", dataclasses.fields(B)[0], bool)]
    with pytest.raises(TypeError, match="'x' is declared with several types"):
        merge_key("x", fields)
