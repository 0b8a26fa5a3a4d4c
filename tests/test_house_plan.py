"""The house plan of docs/design.md, checked on the source: which package may import which, no
import circle between files, no folder holding more than a third of the code, and no module
over 400 lines unless its opening says why.

Imports are read with ``ast`` (every ``import`` statement, lazy ones inside functions
included), so a circle dodged by importing inside a function still counts as a circle.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("partial_fc", "data_pipeline", "trainer", "offline", "launch", "tools")
# Who may import whom (docs/design.md: launch -> offline -> trainer -> data_pipeline ->
# partial_fc, launch also trainer directly; tools and bench on top). A package may always
# import itself.
ALLOWED = {
    "partial_fc": set(),
    "data_pipeline": {"partial_fc"},  # the even split of classes and samples (partition)
    "trainer": {"partial_fc", "data_pipeline"},
    "offline": {"trainer", "partial_fc", "data_pipeline"},
    "launch": {"offline", "trainer", "partial_fc", "data_pipeline"},
    "tools": {"launch", "offline", "trainer", "partial_fc", "data_pipeline"},
}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every source file of the packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (a ``from pkg import sub`` names the submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_packages_import_only_downwards(graph):
    wrong = [f"{name} imports {dep}" for name, deps in graph.items() for dep in sorted(deps)
             if dep.split(".")[0] != name.split(".")[0]
             and dep.split(".")[0] not in ALLOWED[name.split(".")[0]]]
    assert not wrong, "\n".join(wrong)


def test_no_import_circle_between_files(graph):
    """Depth-first search; a package's ``__init__`` importing its own submodules is the one
    edge exempt (the submodule importing a sibling through the package is not a circle)."""
    def edges(name: str) -> set[str]:
        return {dep for dep in graph[name] if not name.startswith(dep + ".")}

    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    circles = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for dep in sorted(edges(name)):
            if state.get(dep) == 1:
                circles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert not circles, "\n".join(circles)


@pytest.mark.parametrize("level", ["folder", "package"])
def test_no_folder_holds_more_than_a_third_of_the_code(level):
    """Neither one folder nor one top-level package (``trainer/`` with its subfolders, say)."""
    lines = Counter()
    for package in (*PACKAGES, "bench"):
        for path in (ROOT / package).rglob("*.py"):
            folder = package if level == "package" else str(path.parent.relative_to(ROOT))
            lines[folder] += len(path.read_text().splitlines())
    total = sum(lines.values())
    heavy = {folder: n for folder, n in lines.items() if n > total / 3}
    assert not heavy, f"{heavy} of {total} lines"


LIMIT = 400  # lines a module holds at most (shared/STYLE.md: files stay under about 400)
WHY = "Over 400 lines because"  # how a longer module's opening says why it is not split


def _opening(text: str) -> str:
    """A module's opening: its leading comment lines and its docstring."""
    comments = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        comments.append(line.lstrip("#").strip())
    return "\n".join([*comments, ast.get_docstring(ast.parse(text)) or ""])


def test_no_module_is_over_400_lines_unless_its_opening_says_why():
    """Every module of the packages and of bench/: at most :data:`LIMIT` lines, or a line of
    its opening comment or docstring starts with :data:`WHY` (where a split would make the
    reading worse, the file stays whole and says so)."""
    long = []
    for package in (*PACKAGES, "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            lines = len(text.splitlines())
            if lines > LIMIT and not any(line.strip().startswith(WHY)
                                         for line in _opening(text).splitlines()):
                long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not long, f"over {LIMIT} lines, and the opening does not say {WHY!r}:\n" \
        + "\n".join(long)
