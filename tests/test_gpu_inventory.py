"""docs/gpu.md's CUDA inventory against the code: every function of the packages that holds a
CUDA-only line is a row of the table, every row names a test that exists (one that reaches the
line on CPU with the device call faked, or the GPU test that will check it), and no row names
a function that no longer holds one. A new CUDA line fails here until its row is written.

A CUDA line, read with ``ast`` (comments and docstrings never count): an attribute named
``cuda``, ``is_cuda``, ``cudnn``, ``pin_memory``, ``channels_last``, ``is_nccl_available``,
``ProcessGroupNCCL``, ``get_accelerator``/``set_accelerator``; a ``pin_memory=``,
``non_blocking=``, ``pg_options=`` or ``device_id=`` argument (the last two: NCCL group
options); the string ``"cuda"`` (``"cuda:N"``, an f-string's ``"cuda:"``), ``"nccl"`` or
``"DS_ACCELERATOR"``; an import from a module whose name holds ``cuda``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("partial_fc", "data_pipeline", "trainer", "launch")
DOC = ROOT / "docs" / "gpu.md"
HEADING = "## CUDA inventory"
ATTRIBUTES = {"cuda", "is_cuda", "cudnn", "pin_memory", "channels_last", "is_nccl_available",
              "ProcessGroupNCCL", "get_accelerator", "set_accelerator"}
KEYWORDS = {"pin_memory", "non_blocking", "pg_options", "device_id"}
STRINGS = re.compile(r"cuda(:\d*)?|nccl|DS_ACCELERATOR")


def _is_cuda(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in ATTRIBUTES
    if isinstance(node, ast.keyword):
        return node.arg in KEYWORDS
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return STRINGS.fullmatch(node.value) is not None
    if isinstance(node, ast.ImportFrom):
        return "cuda" in (node.module or "")
    if isinstance(node, ast.Import):
        return any("cuda" in alias.name for alias in node.names)
    return False


def _sites(path: Path, root: Path = ROOT) -> set[str]:
    """``file:Qual.name`` of every function (or class, or ``<module>``) with a CUDA line."""
    rel = path.relative_to(root).as_posix()
    found: set[str] = set()

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*scope, child.name])
                continue
            if _is_cuda(child):
                found.add(f"{rel}:{'.'.join(scope) or '<module>'}")
            visit(child, scope)

    visit(ast.parse(path.read_text(), str(path)), [])
    return found


def code_sites() -> set[str]:
    return {site for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
            for site in _sites(path)}


def table_rows() -> list[str]:
    """The rows of the table under docs/gpu.md's CUDA inventory heading."""
    text = DOC.read_text()
    assert HEADING in text, f"{DOC}: no '{HEADING}' section"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows, f"{DOC}: the '{HEADING}' section has no table rows"
    return rows


def _row_sites(row: str) -> set[str]:
    return set(re.findall(r"`([\w/]+\.py:[\w.<>]+)`", row.split("|")[1]))


def _row_tests(row: str) -> list[tuple[str, str]]:
    return re.findall(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[^\]`]*\])?`", row)


def test_every_cuda_line_is_in_the_inventory():
    named = set().union(*map(_row_sites, table_rows()))
    missing = sorted(code_sites() - named)
    assert not missing, (
        f"CUDA-only code that {DOC.relative_to(ROOT)}'s '{HEADING}' table does not name: "
        f"{missing}; add a row with the CPU test that reaches it (device call faked) or the "
        "GPU test that checks it")


def test_every_inventory_row_is_a_cuda_site_and_names_tests_that_exist():
    sites = code_sites()
    for row in table_rows():
        named = _row_sites(row)
        assert named, f"{DOC.name}: a row names no `file.py:function`: {row[:100]}"
        stale = sorted(named - sites)
        assert not stale, f"{DOC.name}: {stale} holds no CUDA line (moved or renamed?)"
        tests = _row_tests(row)
        assert tests, f"{DOC.name}: the row of {sorted(named)} names no test node id"
        for file, name in tests:
            source = ROOT / file
            assert source.is_file() and re.search(rf"^def {name}\(", source.read_text(),
                                                  re.M), f"{DOC.name}: no test {file}::{name}"


def test_the_marker_finder_sees_what_it_should(tmp_path):
    """The finder itself: code counts, docstrings and comments do not."""
    source = tmp_path / "pkg" / "mod.py"
    source.parent.mkdir()
    source.write_text('"""cuda in a docstring"""\n'
                      "# torch.cuda in a comment\n"
                      "def quiet(x):\n    'Moves to cuda.'\n    return x.to('cpu')\n"
                      "class A:\n    def copy(self, x):\n"
                      "        return x.to(self.d, non_blocking=True)\n"
                      "def pick(d):\n    return d.type == 'cuda'\n"
                      "def rank_device(r):\n    return f'cuda:{r}'\n"
                      "def group(o):\n    return new_group(pg_options=o)\n"
                      "import torch.cuda\n")
    assert _sites(source, tmp_path) == {f"pkg/mod.py:{name}" for name in (
        "A.copy", "pick", "rank_device", "group", "<module>")}
