"""The docs' commands: fenced ``bash``/``sh``/``shell`` blocks (every line) and ``console`` blocks
(the ``$ `` lines), with the markers a doc puts before a block and the rewrites the check applies.

A marker is an HTML comment (invisible when rendered) on the lines just before the fence:

    <!-- docs-check: --check [SELECT] -->         run with launch.train --check (a GPU recipe,
                                                  a multi-node launch): the config, the data and
                                                  the launch's shape are checked, nothing trains
    <!-- docs-check: skip [SELECT]: REASON -->    not run; REASON is printed with the command

SELECT (optional) is a substring choosing the block's commands it applies to; without it the
marker covers the whole block. A marker that selects nothing is an error (it went stale).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

COMMAND_LANGS = frozenset({"bash", "sh", "shell", "console"})
# An untagged block whose first line starts with one of these is a command left unchecked.
PROGRAMS = frozenset({"python", "python3", ".venv/bin/python", "make", "torchrun", "sbatch",
                      "srun", "bash", "git", "pip"})
_MARK = re.compile(r"^\s*<!--\s*docs-check:\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^\s*```+\s*([\w+-]*)")
_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
# launch.train's --check on this machine's fixtures: no GPU here, and the fixture's counts (the
# manifest fills them) stand in for the recipe's data set.
CHECK_OVERRIDES = ("device=cpu", "data.num_classes=null", "data.num_samples=null")
# A training command that runs here: on the CPU, a few small steps.
RUN_OVERRIDES = ("device=cpu", "train.max_steps=4", "train.batch_size=8")


class DocError(ValueError):
    """A doc the check cannot read as commands: ``where`` is file:line."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class Command:
    """One command as the doc shows it (continuations joined, comments kept), where it is, the
    block's earlier variable assignments (``prelude``), and how the check treats it."""

    where: str
    text: str
    prelude: tuple[str, ...] = ()
    mode: str = "run"  # "run", "check" or "skip"
    reason: str = ""


@dataclass(frozen=True)
class _Marker:
    where: str
    mode: str
    select: str
    reason: str


def parse_marker(where: str, body: str) -> _Marker:
    """``--check [SELECT]`` or ``skip [SELECT]: REASON``."""
    if body == "--check" or body.startswith("--check "):
        return _Marker(where, "check", body[len("--check"):].strip(), "")
    if body.startswith("skip"):
        select, colon, reason = body[len("skip"):].partition(":")
        if colon and reason.strip():
            return _Marker(where, "skip", select.strip(), reason.strip())
    raise DocError(where, f"docs-check marker {body!r}: expected '--check [SELECT]' or "
                          "'skip [SELECT]: REASON'")


def strip_comment(line: str) -> str:
    """The line without a trailing ``# comment`` (a ``#`` after a space, outside quotes)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _commands(doc: str, first: int, lang: str, lines: list[str]) -> list[tuple[str, str]]:
    """(file:line, text) per command: continuations joined, comment lines dropped."""
    out: list[tuple[str, str]] = []
    pending, start = "", 0
    for n, raw in enumerate(lines, first):
        if lang == "console" and not pending:
            if not raw.startswith("$ "):
                continue
            raw = raw[2:]
        line = strip_comment(raw)
        if not pending and not line.strip():
            continue
        start = start if pending else n
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        out.append((f"{doc}:{start}", (pending + line.strip()).strip()))
        pending = ""
    return out


def is_assignment(text: str) -> bool:
    """``name=value`` alone (a shell variable the block's later commands use)."""
    try:
        words = shlex.split(text)
    except ValueError:
        return False
    return bool(words) and all(_ASSIGNMENT.match(w) for w in words)


def read_doc(path: Path, doc: str) -> tuple[list[Command], list[DocError]]:
    """Every command of one doc, markers applied, and the doc's errors: a bad marker, one that
    selects nothing or is not followed by a command block, an untagged block that starts with
    a command. ``doc`` is the name its file:line places use."""
    lines = path.read_text().splitlines()
    commands: list[Command] = []
    errors: list[DocError] = []
    markers: list[_Marker] = []
    i = 0
    while i < len(lines):
        n = i + 1
        mark, fence = _MARK.match(lines[i]), _FENCE.match(lines[i])
        if mark:
            try:
                markers.append(parse_marker(f"{doc}:{n}", mark.group(1)))
            except DocError as e:
                errors.append(e)
            i += 1
            continue
        if not fence:
            if lines[i].strip() and markers:
                errors.append(DocError(markers[0].where, "docs-check marker not followed by a "
                                                         "code block"))
                markers = []
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if _FENCE.match(lines[j])), len(lines))
        body, lang = lines[i + 1:end], fence.group(1).lower()
        if lang in COMMAND_LANGS:
            commands += _apply(markers, _commands(doc, n + 1, lang, body), errors)
        elif markers:
            errors.append(DocError(markers[0].where, f"docs-check marker before a ```{lang} "
                                                     "block"))
        elif not lang and _looks_like_command(body):
            errors.append(DocError(f"{doc}:{n}", "untagged code block starts with a command: tag "
                                                 "it ```bash (the check runs it) or ```text"))
        markers = []
        i = end + 1
    return commands, errors


def _looks_like_command(body: list[str]) -> bool:
    first = next((line.strip() for line in body
                  if line.strip() and not line.lstrip().startswith("#")), "")
    first = first[2:] if first.startswith("$ ") else first
    return first.split(" ", 1)[0] in PROGRAMS


def _apply(markers: list[_Marker], found: list[tuple[str, str]],
           errors: list[DocError]) -> list[Command]:
    out: list[Command] = []
    prelude: list[str] = []
    for where, text in found:
        if is_assignment(text):
            prelude.append(text)
            continue
        mark = next((m for m in markers if m.select in text), None)
        out.append(Command(where, text, tuple(prelude), mark.mode if mark else "run",
                           mark.reason if mark else ""))
    for m in markers:
        if not any(m.select in text for _, text in found):
            errors.append(DocError(m.where, f"docs-check marker selects {m.select!r}, which no "
                                            "command of the block contains"))
    return out
