"""The one YAML reader: every YAML the project reads goes through :func:`read_yaml` (a file)
or :func:`parse_yaml` (a command-line value), bounded whatever the text claims.

Readers: recipes and their ``base:`` chain, ``key=value`` overrides (``launch.train``, the
arcface_torch importer, ``bench/train.py``'s variants), a run folder's ``config.yaml``
(resume with ``--config RUN/config.yaml``, ``launch.export``/``embed``/``evaluate`` through
the checkpoint, also when the run lies in a store and its config.yaml is downloaded beside
the checkpoint; ``launch.report``, the model card, ``launch.overlap``'s held-out list, an
evaluation logged into the run).

YAML lets a short text stand for a huge tree: an alias (``*a``) repeats its anchor's whole
subtree, so nine levels of nine aliases are 9^9 (387 million) items in 400 bytes; PyYAML
shares the repeated objects, so the tree costs nothing until something walks it (a schema
error's message, the schema's validation of a list). The bounds here hold before anything
walks it: the file's size (:data:`MAX_BYTES`), the tree's size as its reader sees it, aliases
expanded (:data:`MAX_NODES`), and its depth (:data:`MAX_DEPTH`, which also keeps PyYAML's
recursive composer and constructor far from Python's recursion limit). A refusal is one line
(:class:`YamlRefused`, exit 2), and :func:`shown_value` cuts any value a message quotes.
"""

from __future__ import annotations

import re
import reprlib
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.events import AliasEvent
from yaml.scanner import ScannerError

from data_pipeline.door import check_size, read_bytes
from trainer.errors import Refused

# A resolved config.yaml is ~2 KB and ~220 nodes; the largest recipe under configs/ is 2 KB.
# 1 MiB in one plain scalar, PyYAML's slowest text per byte, scans in ~0.8 s.
MAX_BYTES = 1 << 20
WHAT = "a YAML config (a config is a few KB)"
MAX_NODES = 10_000
MAX_DEPTH = 32


class YamlRefused(Refused, ValueError):
    """A YAML file or value that cannot be read, is malformed, or exceeds a bound."""


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader with the project's three reading rules.

    - Bounded: the composed tree, each alias counted as the size of the subtree it repeats,
      holds at most :data:`MAX_NODES` nodes and nests at most :data:`MAX_DEPTH` levels; the
      count runs as the text is composed, so a bomb is refused after at most that many nodes
      of work (PyYAML's own advice is to limit aliases; a count of aliases alone would still
      let ~60 aliases in chains of three stand for 3^20 nodes). An alias inside its own
      anchor (a recursive tree, which no config needs and no schema can validate) is refused.
      10,000 nodes is 45 times a resolved config and costs ~0.2 s to compose in pure Python.
    - ``1e-3`` reads as a float (YAML 1.1 wants ``1.0e-3``).
    - A key repeated in one mapping is an error, not "last one wins".
    """

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.expanded = 0  # nodes composed so far, each alias as the size of its subtree
        self.depth = 0
        self.sizes: dict[yaml.Node, int] = {}  # node -> its expanded size, for its aliases

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        mark = self.peek_event().start_mark
        if self.check_event(AliasEvent):
            node = super().compose_node(parent, index)
            if node not in self.sizes:
                raise ComposerError(None, None, "an alias inside its own anchor", mark)
            self._count(self.sizes[node], mark)
            return node
        if self.depth >= MAX_DEPTH:
            raise ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)
        before = self.expanded
        self._count(1, mark)
        self.depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        self.sizes[node] = self.expanded - before
        return node

    def fetch_flow_collection_start(self, token_class: type) -> None:
        """The depth bound where the scanner meets a ``[`` or ``{``, before the composer: the
        scanner looks up to 1024 characters ahead for a simple key at each open flow level,
        so 1000 nested ``[`` took 0.4 s before the composer saw the 33rd."""
        if self.flow_level >= MAX_DEPTH:
            raise ScannerError(None, None, f"nested deeper than {MAX_DEPTH} levels",
                               self.get_mark())
        super().fetch_flow_collection_start(token_class)

    def _count(self, nodes: int, mark: yaml.Mark) -> None:
        self.expanded += nodes
        if self.expanded > MAX_NODES:
            raise ComposerError(None, None, f"more than {MAX_NODES} values once aliases are "
                                "expanded (a config holds a few hundred)", mark)


BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _unique_mapping(loader: BoundedLoader, node: yaml.MappingNode) -> dict:
    """A YAML mapping whose keys are unique: a repeated key is an error, not 'last one wins'."""
    loader.flatten_mapping(node)
    first: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        try:
            seen = key in first
        except TypeError:  # a list or mapping as a key
            raise yaml.constructor.ConstructorError(
                None, None, f"a {type(key).__name__} as a key", key_node.start_mark) from None
        if seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {shown_value(key)} (first set at line "
                f"{first[key] + 1})", key_node.start_mark)
        first[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=True)


BoundedLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def parse_yaml(text: str | bytes, source: str) -> Any:
    """``text`` as YAML under :class:`BoundedLoader`; :class:`YamlRefused` naming ``source``
    (a file, ``command line``) and the line, when it is malformed or exceeds a bound."""
    check_size(len(text), source, WHAT, MAX_BYTES, YamlRefused)
    try:
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise YamlRefused(f"{source}: invalid YAML{where}: {what}") from None
    except ValueError as e:  # a value no Python object holds: 2001-02-30, a 5000-digit int
        raise YamlRefused(f"{source}: invalid YAML value: {str(e).splitlines()[0]}") from None


def read_yaml(path: str | Path, shown: str | None = None) -> Any:
    """The YAML file ``path`` (named ``shown`` in messages) through the door
    (:func:`data_pipeline.door.read_bytes`: at most :data:`MAX_BYTES`, from ``stat`` before
    the read): :func:`parse_yaml` of it, or :class:`YamlRefused` when it cannot be read."""
    name = shown or str(path)
    return parse_yaml(read_bytes(path, WHAT, limit=MAX_BYTES, error=YamlRefused, where=name),
                      name)


def read_mapping(path: str | Path, shown: str | None = None) -> dict:
    """:func:`read_yaml` of a file whose top level is a mapping (a run folder's
    ``config.yaml``); an empty file is ``{}``."""
    data = read_yaml(path, shown)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise YamlRefused(f"{shown or path}: top level must be a mapping, got "
                          f"{type(data).__name__}")
    return data


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 3, 120, 120, 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = _SHORT.maxfrozenset = 4
SHOWN = 160  # characters of a value a message quotes


def shown_value(value: Any) -> str:
    """``repr(value)`` cut to four items a level, three levels and :data:`SHOWN` characters:
    what a message quotes of a value a file set, bounded however large the value is
    (reprlib looks at the items it shows only, so a shared 9^9 tree costs nothing)."""
    text = _SHORT.repr(value)
    return text if len(text) <= SHOWN else text[:SHOWN - 3] + "..."
