"""``python -m tools.text_lint``: text that rots, found before it lands (``make lint``).

Two checks over the repository's code and docs, each a line ``path:line: what`` and exit 1:

- an issue number (``issue 27``) in code: the code says why, the tracker says when;
- a path ``tests/.../test_*.py`` that does not exist in a folder that does: a reference to a
  moved or deleted test (made-up paths in a folder that does not exist, test data, pass).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

CODE = ("partial_fc", "data_pipeline", "trainer", "launch", "tools", "tests", "bench")
DOCS = ("README.md", "docs", "Makefile", "configs", "scripts")
ISSUE = re.compile(r"\bissue [0-9]+", re.IGNORECASE)
TEST_PATH = re.compile(r"\btests/(?:[\w.]+/)*test_\w+\.py")


def _files(root: Path, names: tuple[str, ...], suffixes: tuple[str, ...]) -> Iterator[Path]:
    for name in names:
        path = root / name
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from (p for p in sorted(path.rglob("*"))
                        if p.is_file() and p.suffix in suffixes and ".venv" not in p.parts)


def problems(root: Path) -> list[str]:
    """Every ``path:line: what`` under ``root``."""
    out = []
    code = list(_files(root, CODE, (".py", ".sh")))
    docs = list(_files(root, DOCS, (".md", ".yaml", ".sh", "")))
    this_file = Path(__file__).resolve()
    for path in code + docs:
        is_code = path in code and path.resolve() != this_file  # once a file, not a line
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            where = f"{path.relative_to(root)}:{number}"
            if is_code:
                out += [f"{where}: an issue number in code ({m.group()!r}); say why instead"
                        for m in ISSUE.finditer(line)]
            out += [f"{where}: {m.group()} does not exist" for m in TEST_PATH.finditer(line)
                    if (root / m.group()).parent.is_dir() and not (root / m.group()).is_file()]
    return out


def main(argv: list[str] | None = None) -> int:
    root = Path(argv[0]) if argv else Path.cwd()
    found = problems(root)
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
