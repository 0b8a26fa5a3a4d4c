"""Sub-center training, then ``launch.clean``, on a synthetic set with planted label noise.

    python bench/clean_noise.py [--classes 16] [--images 20] [--every 10] [--epochs 8]
                                [--threshold 75] [--work DIR] [key=value ...]

Writes ``data_pipeline.synthetic.MislabelledSource`` (every ``--every``-th image shows
another identity under its label) to ``WORK/data``, trains the smoke recipe on it with
``margin.subcenters=3`` (one process; trailing ``key=value`` go to ``launch.train``), runs
``python -m launch.clean`` on the run and prints how many samples it listed, how many of them
were planted (precision) and how many of the planted it found (recall), and the training
time. Asserts nothing (``tests/offline/test_cleaning.py`` holds the cheap, constructed
check).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/clean_noise.py", description=__doc__.split("\n")[0])
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--images", type=int, default=20, help="images per identity")
    p.add_argument("--every", type=int, default=10, help="one planted image per this many")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--threshold", type=float, default=75.0)
    p.add_argument("--work", type=Path, help="folder for data and run (default: a temp one)")
    p.add_argument("overrides", nargs="*", help="key=value for launch.train")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from data_pipeline.exclusion import read_exclusions
    from data_pipeline.synthetic import MislabelledSource
    from data_pipeline.writer import write_dataset
    from launch import clean, train

    work = args.work or Path(tempfile.mkdtemp(prefix="clean_noise-"))
    shutil.rmtree(work / "run", ignore_errors=True)
    source = MislabelledSource(args.classes, args.images, seed=0, every=args.every)
    write_dataset(source, work / "data", shuffle_seed=None)
    start = time.perf_counter()
    rc = train.main(["--config", str(ROOT / "configs" / "smoke.yaml"), f"data.dir={work / 'data'}",
                     f"output={work / 'run'}", "engine.type=ddp", "data.num_workers=0",
                     "train.batch_size=16", f"train.epochs={args.epochs}", "log.hist_every=0",
                     "checkpoint.every=0", "margin.type=arcface", "margin.s=16", "margin.m=0.3",
                     "margin.subcenters=3", *args.overrides])
    seconds = time.perf_counter() - start
    if rc:
        return rc
    out = work / "noisy.txt"
    rc = clean.main(["--checkpoint", str(work / "run"), "--data", str(work / "data"),
                     "--out", str(out), "--threshold", str(args.threshold)])
    if rc:
        return rc
    listed = read_exclusions(out).samples
    planted = {f"{i:09d}" for i in source.planted}
    hits = len(listed & planted)
    print(f"{args.classes} identities x {args.images} images, {len(planted)} planted; "
          f"{args.epochs} epochs in {seconds:.0f} s; listed {len(listed)} at "
          f"{args.threshold:g} degrees: precision {hits / max(len(listed), 1):.3f}, "
          f"recall {hits / len(planted):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
