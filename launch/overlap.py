"""Find the training identities that also appear in the evaluation sets, and list them for
``data.exclude``.

Command line (one process, or every rank of torchrun)::

    python -m launch.overlap --checkpoint RUN --data DIR --bins lfw.bin,cfp_fp.bin
        [--ijb IJB_release --ijb-target IJBC] [--threshold 0.5] --out overlap.txt

Each training identity's centre (mean unit embedding over its images in DIR's shards) is
compared with every evaluation image; an identity within the cosine threshold of any image
is listed (``class LABEL`` lines, DIR's own labels). Train again with
``data.exclude=overlap.txt`` (with ``data.dirs``: run once per folder, one list each). The
work is ``offline.overlap``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from data_pipeline.exclusion import Exclusions, made_by, write_exclusions
from data_pipeline.ijb import TARGETS
from data_pipeline.verification_bin import MISSING_BIN_FIX
from launch.cli import checkpoint_program_parser, load_backbone_or_exit
from offline.overlap import DEFAULT_THRESHOLD


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = checkpoint_program_parser("launch.overlap", __doc__)
    p.add_argument("--data", type=Path, required=True, help="the training shard folder")
    p.add_argument("--bins", default="", help="comma-separated verification .bin files")
    p.add_argument("--ijb", type=Path, metavar="DIR",
                   help="IJB_release folder (or its IJBB/IJBC sub-folder holding meta/)")
    p.add_argument("--ijb-target", choices=TARGETS, default="IJBC")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help=f"cosine between a centre and an image that counts as the same "
                   f"identity (default {DEFAULT_THRESHOLD})")
    p.add_argument("--out", type=Path, required=True, help="the exclusion list to write")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    args = p.parse_args(argv)
    args.bins = [b for b in args.bins.split(",") if b.strip()]
    if not args.bins and args.ijb is None:
        p.error("nothing to compare with: give --bins and/or --ijb")
    for path in args.bins:
        if not Path(path).is_file():
            p.error(f"--bins {path}: no such file ({MISSING_BIN_FIX})")
    if len({Path(b).stem for b in args.bins}) != len(args.bins):
        p.error(f"--bins {','.join(args.bins)}: two sets with the same file name")
    if not -1 <= args.threshold <= 1:
        p.error(f"--threshold {args.threshold}: a cosine, in [-1, 1]")
    if not (args.data / "manifest.json").is_file():
        p.error(f"--data {args.data}: no manifest.json (a folder launch.convert wrote)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    from data_pipeline.verification_bin import read_bin
    from offline.overlap import bin_images, class_centres, ijb_images, set_overlap
    from trainer import dist

    env = dist.init_distributed(args.device)
    try:
        backbone = load_backbone_or_exit(args.checkpoint).to(env.device)
        centres, counts = class_centres(backbone, args.data, args.batch_size, env.device,
                                        env.group)
        sources = []
        for path in args.bins:
            unique = list(dict.fromkeys(read_bin(path)[0]))
            sources.append((Path(path).stem, bin_images(unique, args.batch_size), len(unique)))
        if args.ijb is not None:
            from data_pipeline.ijb import read_ijb_meta

            meta = read_ijb_meta(args.ijb, args.ijb_target)
            sources.append((args.ijb_target, ijb_images(meta, args.batch_size),
                            len(meta.names)))
        results = [set_overlap(name, source, count, backbone, centres, args.threshold,
                               args.batch_size, env.device, env.group)
                   for name, source, count in sources]
    finally:
        dist.shutdown()
    if env.is_main:
        shared = frozenset().union(*(r.classes for r in results))
        header = made_by("launch.overlap", {"checkpoint": args.checkpoint, "data": args.data,
                                             "threshold": f"{args.threshold:g}",
                                             "sets": ",".join(r.name for r in results)},
                         f"{len(shared)} of {int((counts > 0).sum())} training identities "
                         "shared")
        write_exclusions(args.out, Exclusions(classes=shared), header=header)
        print(format_table(results))
        print(f"{len(shared)} training identities listed in {args.out} (train with "
              f"data.exclude={args.out})")
    return 0


def format_table(results) -> str:
    """One row per evaluation set: its images, those matched, the identities it shares."""
    rows = [("set", "images", "matched images", "shared identities")]
    rows += [(r.name, str(r.images), str(r.matched_images), str(len(r.classes)))
             for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
                     for row in rows)


if __name__ == "__main__":
    sys.exit(main())
