"""Runs the docs' commands, each doc in a fresh copy of the repository (what a clone holds), and
judges each: a non-zero exit, a Python traceback in its output, or a command it printed for the
user that then fails is a failure, named by file:line, the command and the reason. An S3 store
runs beside them (moto's server on loopback, tools/remote_servers.py, with a bucket
``bucket``), its endpoint and keys in the commands' AWS_* variables, so a documented
``s3://bucket/...`` URL is written and read for real."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tools.docs_check.blocks import Command, read_doc
from tools.docs_check.fixtures import Fixtures, printed_table, run_python, table
from tools.docs_check.rewrite import CannotRewrite, for_check, for_run, printed_commands, substitute
from tools.remote_servers import S3Server

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900  # one command; the slowest documented one (make train) takes about 2 minutes
TAIL = 20  # output lines shown with a failure


@dataclass
class Outcome:
    ran: str
    reasons: list[str]
    output: str
    seconds: float


def copy_repository(dest: Path) -> Path:
    """The repository's files as a clone holds them (tracked and new, not ignored), with the
    running interpreter's environment as ``.venv``; a folder already there is replaced."""
    shutil.rmtree(dest, ignore_errors=True)
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, names.split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    (dest / ".venv").symlink_to(Path(sys.prefix).resolve())
    return dest


def environment(copy: Path) -> dict:
    """A user's shell with the environment active, in the copy; make skips setup (this check
    runs after it), uses the same interpreter and does not echo its recipes' lines (they are
    not commands printed for the user to type)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(copy)
    env["MAKEFLAGS"] = f"-s PY={sys.executable} SETUP="
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def execute(script: str, copy: Path, env: dict) -> Outcome:
    start = time.monotonic()
    try:
        r = subprocess.run(["bash", "-c", script], cwd=copy, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
        rc, output = r.returncode, r.stdout
    except subprocess.TimeoutExpired as e:
        rc, output = None, (e.stdout or b"").decode(errors="replace")
    reasons = ([f"timed out after {TIMEOUT_S} s"] if rc is None else
               [f"exit {rc}"] if rc else [])
    if "Traceback (most recent call last)" in output:
        reasons.append("a Python traceback in its output")
    return Outcome(script.splitlines()[-1], reasons, output, time.monotonic() - start)


def check_command(cmd: Command, copy: Path, env: dict, fixtures: Fixtures, doc: str) -> list[str]:
    """Runs one command and the commands it prints; returns its report lines."""
    try:
        text = substitute(cmd.text, table(doc), fixtures.path)
        text = for_check(text, copy) if cmd.mode == "check" else for_run(text)
    except (CannotRewrite, RuntimeError) as e:  # RuntimeError: a fixture that failed to build
        return [f"FAIL  {cmd.where}  {cmd.text}: {e}"]
    outcome = execute("\n".join([*cmd.prelude, text]), copy, env)
    label = "check" if cmd.mode == "check" else "ok"
    if outcome.reasons:
        return _failure(cmd, outcome, "; ".join(outcome.reasons))
    lines = [f"{label:5} {outcome.seconds:6.1f}s  {cmd.where}  {cmd.text}"]
    for printed in printed_commands(outcome.output):
        # in a copy of the folder as it is now: the doc's next command finds what it would
        scratch = copy.with_name(copy.name + ".printed")
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.copytree(copy, scratch, symlinks=True)
        then = execute(for_run(substitute(printed, printed_table(doc), fixtures.path)), scratch,
                       {**env, "PYTHONPATH": str(scratch)})
        shutil.rmtree(scratch, ignore_errors=True)
        if then.reasons:
            return lines + _failure(cmd, then, f"the command it printed, `{printed}`, then "
                                                f"failed: {'; '.join(then.reasons)}")
        lines.append(f"ok    {then.seconds:6.1f}s    printed: {printed}")
    return lines


def _failure(cmd: Command, outcome: Outcome, reason: str) -> list[str]:
    tail = outcome.output.rstrip().splitlines()[-TAIL:]
    return [f"FAIL  {cmd.where}  {cmd.text}: {reason}", f"      ran: {outcome.ran}",
            *(f"      | {line}" for line in tail)]


def _docs(names: list[str]) -> dict[str, Path]:
    """name (relative to the repository where inside it) -> path."""
    paths = ([Path(n).resolve() for n in names] if names else
             [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    return {str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p): p for p in paths}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.docs_check", description=__doc__)
    p.add_argument("docs", nargs="*", help="the docs to check (default README.md, docs/*.md)")
    p.add_argument("--list", action="store_true", help="print the commands and how each is "
                   "run, run nothing")
    p.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a "
                   "temporary one, removed); its fixtures are reused by the next --keep run")
    args = p.parse_args(argv)
    commands, errors = {}, []
    for name, path in _docs(args.docs).items():
        commands[name], found = read_doc(path, name)
        errors += [f"FAIL  {e}" for e in found]
    if args.list:
        for cmds in commands.values():
            for c in cmds:
                print(f"{c.mode:5} {c.where}  {c.text}" + (f"  ({c.reason})" if c.reason else ""))
        print("\n".join(errors))
        return 1 if errors else 0
    work = args.keep or Path(tempfile.mkdtemp(prefix="docs-check-"))
    work.mkdir(parents=True, exist_ok=True)
    store = S3Server()
    try:
        store.make_bucket("bucket")
        failed = len(errors)
        print("\n".join(errors), flush=True) if errors else None
        fixture_copy = copy_repository(work / "fixture-repo")
        fixtures = Fixtures(work / "fixtures", run_python(fixture_copy, environment(fixture_copy)))
        for name, cmds in commands.items():
            copy = copy_repository(work / name.strip("/").replace("/", "_"))
            env = {**environment(copy), **store.environment(),
                   "AWS_EC2_METADATA_DISABLED": "true"}
            for cmd in cmds:
                if cmd.mode == "skip":
                    print(f"skip          {cmd.where}  {cmd.text}: {cmd.reason}", flush=True)
                    continue
                lines = check_command(cmd, copy, env, fixtures, name)
                failed += any(line.startswith("FAIL") for line in lines)
                print("\n".join(lines), flush=True)
        print(f"docs-check: {failed} failed" if failed else "docs-check: every command passed")
        return 1 if failed else 0
    finally:
        store.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
