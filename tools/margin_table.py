"""``python -m tools.margin_table``: docs/margins.md's tables of the margin types and of the
keys every type reads, written from ``partial_fc.margins.REGISTRY`` between the doc's markers,
so a default or a paper is written once, in its margin's file. ``--check`` writes nothing and
exits 1 when the doc's tables differ from the registry's (a test runs it)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from partial_fc.margins.keys import SharedConfig
from partial_fc.margins.registry import REGISTRY

DOC = Path(__file__).resolve().parents[1] / "docs" / "margins.md"
BEGIN = "<!-- margin-table: begin (python -m tools.margin_table writes it from the registry) -->"
END = "<!-- margin-table: end -->"


def _cell(text: Any) -> str:
    """A table cell: booleans as YAML writes them, numbers as short as they read, ``|``
    escaped."""
    if isinstance(text, bool):
        return "true" if text else "false"
    if isinstance(text, float):
        return f"{text:g}"
    return "null" if text is None else str(text).replace("|", "\\|")


def table() -> str:
    """The two tables, as markdown: one row per ``margin.type``, one per shared key."""
    lines = ["| `margin.type` | ψ (target) and other changes | its own keys (defaults) | paper |",
             "| --- | --- | --- | --- |"]
    for name, spec in REGISTRY.items():
        own = ", ".join(f"`{f.name}` {_cell(f.default)}"
                        for f in dataclasses.fields(spec.config)) or "none"
        lines.append(f"| `{name}` | {_cell(spec.psi)} | {own} | {_cell(spec.paper)} |")
    lines += ["", "Every type also reads these keys:", "",
              "| key | default | what it does |", "| --- | --- | --- |"]
    lines += [f"| `margin.{f.name}` | {_cell(f.default)} | {_cell(f.metadata['description'])} |"
              for f in dataclasses.fields(SharedConfig)]
    return "\n".join(lines)


def rewritten(text: str) -> str:
    """``text`` (the doc) with what lies between its markers replaced by :func:`table`."""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"{DOC}: the markers {BEGIN!r} and {END!r} are missing")
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.margin_table", description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when docs/margins.md differs")
    args = parser.parse_args(argv)
    text = DOC.read_text()
    want = rewritten(text)
    if args.check:
        if want != text:
            print(f"{DOC}: its margin tables differ from the registry's; run "
                  "python -m tools.margin_table", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
