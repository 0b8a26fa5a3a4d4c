"""The margin registry: every type builds from its declared defaults, and a key of another
type is refused naming the types that read it."""

import dataclasses

from partial_fc.margins.keys import MarginSpec
from partial_fc.margins.registry import (
    REGISTRY,
    SHARED_KEYS,
    foreign_key_error,
    margin_errors,
    own_keys,
    schema_keys,
)


def test_every_type_builds_from_its_declared_defaults():
    for name, spec in REGISTRY.items():
        assert isinstance(spec, MarginSpec) and spec.name == name
        config = spec.config()
        assert dataclasses.is_dataclass(config)
        assert not getattr(config, "errors", lambda: [])(), name
        keys = [k.name for k in schema_keys(name)]
        assert keys == ["type", *SHARED_KEYS, *own_keys(name)], name


def test_a_key_of_another_type_names_the_types_that_read_it():
    assert foreign_key_error("cosface", "sigma", 0.1) == (
        "margin.sigma", "margin.sigma=0.1: only read by margin.type=elasticface_arc|"
        "elasticface_cos|elasticface_arc_plus|elasticface_cos_plus (cosface's own keys: m)")
    assert foreign_key_error("cosface", "nope", 1) is None  # no type reads it: unknown
    assert margin_errors({"type": "normface", "h": 0.3}) == [
        ("margin.h", "margin.h=0.3: only read by margin.type=adaface (normface's own keys: "
         "none)")]
    ((key, msg),) = margin_errors({"type": "normface", "nope": 1})
    assert key == "margin" and "unknown key(s) ['nope']" in msg


def test_docs_margin_tables_are_the_registrys(tmp_path):
    """docs/margins.md's tables are what ``python -m tools.margin_table`` writes from the
    registry: a default changed in a margin's file and not in the doc fails here."""
    from tools.margin_table import DOC, main, rewritten

    text = DOC.read_text()
    assert rewritten(text) == text, "docs/margins.md differs: run python -m tools.margin_table"
    assert main(["--check"]) == 0
    stale = text.replace("| `m` 0.35 |", "| `m` 0.3 |", 1)  # a default written twice, drifted
    assert stale != text and rewritten(stale) == text
