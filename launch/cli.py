"""What the programs in ``launch/`` share on the command line: help text from module
docstrings and the ``--checkpoint`` option of ``evaluate`` and ``export``."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from torch import nn

from trainer.checkpoint.backbone import CheckpointError, load_backbone, resolve_checkpoint
from trainer.errors import EXIT_STATUS

T = TypeVar("T")

__all__ = ["EXIT_STATUS", "checkpoint_program_parser", "load_backbone_or_exit", "plain_help",
           "resolve_checkpoint_or_exit"]


def plain_help(doc: str) -> str:
    """A module docstring as ``--help`` text: reST roles and literals (``:func:`x```,
    double backticks, ``::``) become the plain words they mark up."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc)
    text = re.sub(r"``([^`]+)``|`([^`]+)`", lambda m: m.group(1) or m.group(2), text)
    return re.sub(r"::$", ":", text, flags=re.M).strip()


def checkpoint_program_parser(program: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of a program that reads a trained backbone (``launch.evaluate``, ``export``,
    ``clean``, ``overlap``): its module docstring as the help, the exit statuses, and the
    ``--checkpoint`` option they share."""
    parser = argparse.ArgumentParser(prog=f"python -m {program}", description=plain_help(doc),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=EXIT_STATUS)
    parser.add_argument("--checkpoint", required=True,
                        help="RUN folder (a path or a URL), RUN/checkpoints/<tag>, or "
                        ".../backbone.pt")
    return parser


def load_backbone_or_exit(path: str | os.PathLike) -> nn.Module:
    """:func:`load_backbone` for a program's ``--checkpoint``: a :class:`CheckpointError`
    ends the program with its one line (``error: ...``) and exit status 2, as any bad input
    (the checkpoint is the program's input), not a traceback."""
    return _or_exit(load_backbone, path)[0]


def resolve_checkpoint_or_exit(path: str | os.PathLike) -> tuple[Path, Path]:
    """:func:`resolve_checkpoint` (``(RUN/config.yaml, .../backbone.pt)``) for a program's
    ``--checkpoint``, ending the program as :func:`load_backbone_or_exit` does."""
    return _or_exit(resolve_checkpoint, path)


def _or_exit(read: Callable[[str | os.PathLike], T], path: str | os.PathLike) -> T:
    try:
        return read(path)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
