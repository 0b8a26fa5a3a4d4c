"""The README stays a ten-minute read and the user docs speak to users: no issue numbers or
commit hashes, and every program and make target they name exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
USER_DOCS = [ROOT / "README.md"] + [ROOT / "docs" / f"{n}.md"
                                    for n in ("benchmarks", "training", "data", "evaluation")]


def test_readme_is_short():
    """Every line counted, the docs-check markers (HTML comments) too: what a reader scrolls
    past in an editor."""
    assert len((ROOT / "README.md").read_text().splitlines()) < 200


def test_user_docs_name_no_issues_or_commits_and_only_real_programs():
    named: set[str] = set()
    for doc in USER_DOCS:
        # A merge list's example set line ends in its folder's content digest, not a commit.
        text = re.sub(r"^set \d+ \S+ \d+ [0-9a-f]{16}$", "", doc.read_text(), flags=re.M)
        assert not re.search(r"\bissue \d+|#\d+\b", text, re.I), doc.name
        assert not re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", text), doc.name
        for module in re.findall(r"python -m (launch\.\w+)", text):
            path = ROOT / module.replace(".", "/")  # a module, or a package with __main__
            assert (path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()), (
                doc.name, module)
        named |= set(re.findall(r"`make ([\w./-]+)", text))
    for target in sorted(named):  # make -n: a target without a rule fails, nothing runs
        result = subprocess.run(["make", "-n", "-C", str(ROOT), target], capture_output=True,
                                text=True, timeout=60)
        assert "No rule to make target" not in result.stderr, (target, result.stderr)
