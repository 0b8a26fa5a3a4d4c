"""``--held-out``, which both modes of ``launch.overlap`` read: the classes of an exclusion
list the model was trained with, whose images (or centres) it never saw, the calibration's
null probes (``offline.overlap.held_out`` reads a run's own list instead)."""

from __future__ import annotations

import argparse
from pathlib import Path

from data_pipeline.errors import DataError
from data_pipeline.exclusion import read_exclusions


def held_out_classes(p: argparse.ArgumentParser, path: Path) -> frozenset[int]:
    """The classes of the exclusion list the model was trained with; a parser error names a
    missing or unreadable list, or one without classes."""
    try:
        classes = read_exclusions(path).classes
    except (OSError, DataError) as err:
        p.error(f"--held-out {path}: {str(err).splitlines()[0]}")
    if not classes:
        p.error(f"--held-out {path}: no `class` lines (the calibration needs identities the "
                "model never saw, not single samples)")
    return classes
