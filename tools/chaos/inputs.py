"""``make chaos`` rows whose fault is the input: a label past ``num_classes``, a corrupt JPEG,
a duplicate YAML key, a batch and an output folder that cannot be (listed in
``tools/chaos/cases.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tools.testbed.harness import ROOT, SMOKE, train, write_data


def bad_label(data: Path, work: Path) -> tuple[str, bool]:
    bad = write_data(work / "data", labels={i: 25 for i in range(0, 160, 10)})
    r = train(bad, work / "run", "data.num_workers=1")
    errors = r.errors()
    named = len(errors) == 1 and "shard-" in errors[0] and "has label 25" in errors[0]
    return f"rc {r.rc}, {len(errors)} line(s): {errors[0][:100] if errors else '-'}", \
        r.rc == 1 and named and "Traceback" not in r.out


def corrupt_image_two_epochs(data: Path, work: Path) -> tuple[str, bool]:
    bad = write_data(work / "data", corrupt=(7,))
    r = train(bad, work / "run", "train.max_steps=null", "train.epochs=2")
    last = (r.records() or [{}])[-1]
    return f"rc {r.rc}, skipped_samples after 2 epochs: {last.get('skipped_samples')}", \
        r.rc == 0 and last.get("skipped_samples") == 1


def duplicate_yaml_key(data: Path, work: Path) -> tuple[str, bool]:
    recipe = work / "dup.yaml"
    recipe.write_text(f"base: {SMOKE}\nmargin:\n  s: 30.0\n  s: 64.0\n")
    cmd = [sys.executable, "-m", "launch.train", "--config", str(recipe), f"data.dir={data}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    named = "duplicate key 's' (first set at line 3)" in out.stderr
    return f"rc {out.returncode}, names the key and both lines: {named}", \
        out.returncode == 2 and named


def early_checks(data: Path, work: Path) -> tuple[str, bool]:
    blocker = work / "a-file"
    blocker.write_text("")
    r = train(data, blocker / "run", "train.batch_size=100000")
    lines = [line for line in r.out.splitlines() if "train.batch_size=100000" in line
             or "is not a folder" in line]
    return f"rc {r.rc}, {len(lines)} of 2 problems named before any process group", \
        r.rc == 2 and len(lines) == 2 and "Traceback" not in r.out
