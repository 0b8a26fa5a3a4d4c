"""``python -m tools.chaos`` (``make chaos``): run every fault case and print one table.

``python -m tools.chaos inject FAULT [FAULT ...] -- <launch.train arguments>`` is the
subprocess form the cases use for faults that need a hand inside the trainer process: each
FAULT attaches a hook to a seam the trainer declares (``trainer/seams.py``), then the run starts.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from launch.cli import plain_help
from tools.chaos.cases import CASES, run_case
from tools.testbed import harness


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["inject"]:
        return _inject(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m tools.chaos", description=plain_help(
        harness.__doc__.split("\n\n")[0]))
    parser.add_argument("-k", default="", help="run only cases whose name contains this")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    try:
        data = harness.write_data(work / "data")
        rows = []
        for case in CASES:
            if args.k in case.name:
                start = time.perf_counter()
                observed, holds = run_case(case, data, work)
                rows.append((case.name, case.expected, observed, holds))
                took = time.perf_counter() - start
                print(f"{'ok ' if holds else 'BAD'} {case.name} ({took:.0f} s)", file=sys.stderr,
                      flush=True)
        print(harness.table(rows))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r[3] for r in rows) else 1


def _inject(argv: list[str]) -> int:
    """``inject FAULT [FAULT ...] -- <launch.train arguments>``."""
    split = argv.index("--")
    for fault in argv[:split]:
        harness.FAULTS[fault]()
    from launch.train import main as train_main

    return train_main(argv[split + 1 :], keep_host_heap=True)  # as the program runs


if __name__ == "__main__":
    sys.exit(main())
