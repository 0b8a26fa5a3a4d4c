"""What the check changes in a doc's command before running it: placeholders -> fixtures, a
``--check`` marker -> launch.train's --check, a training run -> a few steps on the CPU; and the
commands a program prints for the user to type next."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path

from tools.docs_check.blocks import CHECK_OVERRIDES, RUN_OVERRIDES

_PYTHON = r"(?:python3?|\.venv/bin/python)"
_TRAIN = re.compile(rf"^{_PYTHON} -m launch\.train\b")
# up to a ';', a ', ' (prose goes on) or the line's end
_PRINTED = re.compile(rf"(?:{_PYTHON} -m launch\.\w+|torchrun) (?:[^;,\n]|,(?! ))*")


class CannotRewrite(ValueError):
    """A ``--check`` marker on a command the check does not know how to check."""


def substitute(text: str, table: Mapping[str, str], resolve: Callable[[str], str]) -> str:
    """Each placeholder (a key of ``table``, longest first, as a whole word or a path's head)
    replaced by ``resolve(table[key])``."""
    if not table:
        return text
    keys = sorted(table, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w./-])(" + "|".join(map(re.escape, keys)) + r")(?![\w-]|\.\w)")
    return pattern.sub(lambda m: resolve(table[m.group(1)]), text)


def for_check(text: str, root: Path) -> str:
    """The command a ``--check`` marker runs instead of ``text``."""
    words = shlex.split(text)
    extra = " " + " ".join(CHECK_OVERRIDES)
    if words[0] == "make":  # the recipe's own --check line; torchrun replaced by `true`
        # NPROC_PER_NODE's default, `gpu` (all of this node's), means a node of 8 here
        shape = "" if any(w.startswith("NPROC_PER_NODE=") for w in words) else " NPROC_PER_NODE=8"
        return f"{text}{shape} TORCHRUN=true {shlex.quote('ARGS+=' + extra.strip())}"
    if _TRAIN.match(text):
        return (text if "--check" in words else
                re.sub(r"-m launch\.train\b", "-m launch.train --check", text, count=1)) + extra
    if "launch.train" in words and (words[0] == "torchrun" or "launch.torchrun" in words):
        rest = words[words.index("launch.train") + 1:]
        opts = words[:words.index("launch.train")]
        shape = f"--nproc-per-node {_option(opts, 'nproc')} --nnodes {_option(opts, 'nnodes')}"
        return f"python -m launch.train --check {shape} {shlex.join(rest)}{extra}"
    if words[0] == "sbatch":
        script = (root / words[1]).read_text()
        nodes, gpus = (re.search(rf"#SBATCH --{k}=(\d+)", script)
                       for k in ("nodes", "gpus-per-node"))
        if not (nodes and gpus):
            raise CannotRewrite(f"{words[1]}: no '#SBATCH --nodes=' and '--gpus-per-node=' lines")
        return (f"bash -n {shlex.quote(words[1])} && python -m launch.train --check "
                f"--nproc-per-node {gpus.group(1)} --nnodes {nodes.group(1)} "
                f"--config {shlex.join(words[2:])}{extra}")
    raise CannotRewrite("--check knows launch.train, torchrun or launch.torchrun running it, "
                        "make's recipes and sbatch; mark this command skip with a reason instead")


def _option(words: list[str], name: str) -> str:
    """torchrun's --nproc_per_node / --nproc-per-node / --nnodes value (1 when absent)."""
    names = {"nproc": ("--nproc_per_node", "--nproc-per-node"), "nnodes": ("--nnodes",)}[name]
    for i, w in enumerate(words):
        key, eq, value = w.partition("=")
        if key in names:
            return value if eq else words[i + 1]
    return "1"


def for_run(text: str) -> str:
    """A training command that runs here gets RUN_OVERRIDES (later overrides win)."""
    if "-m launch.train" in text and "--check" not in text.split():
        return f"{text} {' '.join(RUN_OVERRIDES)}"
    return text


def printed_commands(output: str) -> list[str]:
    """The commands a program told the user to type (``python -m launch.X ...`` or ``torchrun
    ...`` up to a ``;``, a ``, `` or the line's end); a template holding ``...`` is left out."""
    found = (m.group(0).rstrip() for m in _PRINTED.finditer(output))
    ends = (c.rstrip(".)'\"`").rstrip() for c in found if "..." not in c)
    return list(dict.fromkeys(ends))
