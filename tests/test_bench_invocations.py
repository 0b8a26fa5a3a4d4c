"""Every bench runs as its docstring says: ``python bench/NAME.py`` (or ``.venv/bin/python``,
``python3``, under ``nice``), a script run from the checkout with nothing else set. A script's
own folder, bench/, comes first on its ``sys.path``, not the checkout's root, so a bench that
imports what is not installed (tools/, the test helpers) puts the root there itself.

Each is run to ``--help``, past its imports, in one Python process (torch imported once, not
once a bench): runpy runs it as ``__main__`` with ``sys.path`` as a script's would be and the
uninstalled packages forgotten between benches, so one bench cannot import them for another."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a bench is a script (it has a __main__ block); a module the scripts import (head_peers.py) is not
BENCHES = sorted(path for path in (ROOT / "bench").glob("*.py")
                 if 'if __name__ == "__main__":' in path.read_text())
# an interpreter, optionally under nice, and the script: no PYTHONPATH=, no -m
INVOCATION = re.compile(r"^\s*(?:nice -n \d+ )?(?:\.venv/bin/)?python3? (bench/\w+\.py)\b", re.M)

DRIVER = """
import os, runpy, sys, traceback
base = list(sys.path[1:])  # sys.path[0]: the -c script's folder, not a script's
for script in sys.argv[1:]:
    sys.path[:] = [os.path.dirname(script), *base]
    for name in [m for m in sys.modules if m.split(".")[0] in ("tools", "tests", "bench")]:
        del sys.modules[name]
    sys.argv = [script, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
        code = "no exit"
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        code = traceback.format_exc(limit=-1).strip().splitlines()[-1]
    print("bench", os.path.basename(script), code, flush=True)
"""


def test_every_bench_documents_its_own_script_invocation():
    for bench in BENCHES:
        named = INVOCATION.findall(ast.get_docstring(ast.parse(bench.read_text())) or "")
        assert f"bench/{bench.name}" in named, (bench.name, "no `python bench/NAME.py` line")


def test_every_bench_gets_past_its_imports_run_as_its_docstring_says(tmp_path):
    done = subprocess.run([sys.executable, "-c", DRIVER, *map(str, BENCHES)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    results = dict(line.split(" ", 2)[1:] for line in done.stdout.splitlines()
                   if line.startswith("bench "))
    assert results == {bench.name: "0" for bench in BENCHES}, done.stderr[-2000:]
