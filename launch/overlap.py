"""Find the training identities that also appear in the evaluation sets, and list them for
``data.exclude``.

Command line (one process, or every rank of torchrun)::

    python -m launch.overlap --checkpoint RUN --data DIR --bins lfw.bin,cfp_fp.bin
        [--ijb IJB_release --ijb-target IJBC] [--fmr 1e-3 | --threshold T] --out overlap.txt

Each training identity's centre (mean unit embedding over its images in DIR's shards) is
compared with every evaluation image; an identity within the cosine threshold of any image
is listed. The threshold comes from the model itself: the cosine that a share ``--fmr`` of the
.bins' own impostor pairs reach (printed with how it was chosen); ``--threshold`` sets it
instead (without --bins it is 0.5). Identities are listed as ``class LABEL`` lines (DIR's own
labels). Train again with ``data.exclude=overlap.txt`` (with ``data.dirs``: run once per
folder, one list each). The work is ``offline.overlap``.
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
from offline.overlap import DEFAULT_FMR, DEFAULT_THRESHOLD


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = checkpoint_program_parser("launch.overlap", __doc__)
    p.add_argument("--data", type=Path, required=True, help="the training shard folder")
    p.add_argument("--bins", default="", help="comma-separated verification .bin files")
    p.add_argument("--ijb", type=Path, metavar="DIR",
                   help="IJB_release folder (or its IJBB/IJBC sub-folder holding meta/)")
    p.add_argument("--ijb-target", choices=TARGETS, default="IJBC")
    p.add_argument("--threshold", type=float, default=None,
                   help="cosine between a centre and an image that counts as the same "
                   "identity (default: calibrated at --fmr on the .bins' impostor pairs; "
                   f"{DEFAULT_THRESHOLD} with --ijb alone)")
    p.add_argument("--fmr", type=float, default=DEFAULT_FMR,
                   help="false-match rate of the .bins' impostor pairs the threshold is set "
                   f"at (default {DEFAULT_FMR:g})")
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
    if args.threshold is not None and not -1 <= args.threshold <= 1:
        p.error(f"--threshold {args.threshold}: a cosine, in [-1, 1]")
    if not 0 < args.fmr < 1:
        p.error(f"--fmr {args.fmr}: a rate, in (0, 1)")
    if not (args.data / "manifest.json").is_file():
        p.error(f"--data {args.data}: no manifest.json (a folder launch.convert wrote)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    from data_pipeline.verification_bin import read_bin
    from offline.overlap import bin_images, class_centres, ijb_images, impostor_cosines, set_overlap
    from trainer import dist

    env = dist.init_distributed(args.device)
    try:
        backbone = load_backbone_or_exit(args.checkpoint).to(env.device)
        centres, counts = class_centres(backbone, args.data, args.batch_size, env.device,
                                        env.group)
        sources, impostors = [], []
        for path in args.bins:
            encoded, issame = read_bin(path)
            unique = list(dict.fromkeys(encoded))
            sources.append((Path(path).stem, bin_images(unique, args.batch_size), len(unique)))
            if args.threshold is None:
                impostors.append(impostor_cosines(backbone, encoded, issame, args.batch_size,
                                                  env.device))
        threshold, how = _threshold(args, impostors)
        if env.is_main:
            print(how)
        if args.ijb is not None:
            from data_pipeline.ijb import read_ijb_meta

            meta = read_ijb_meta(args.ijb, args.ijb_target)
            sources.append((args.ijb_target, ijb_images(meta, args.batch_size),
                            len(meta.names)))
        results = [set_overlap(name, source, count, backbone, centres, threshold,
                               args.batch_size, env.device, env.group)
                   for name, source, count in sources]
    finally:
        dist.shutdown()
    if env.is_main:
        shared = frozenset().union(*(r.classes for r in results))
        header = made_by("launch.overlap", {"checkpoint": args.checkpoint, "data": args.data,
                                             "threshold": f"{threshold:.4g}",
                                             "sets": ",".join(r.name for r in results)},
                         f"{len(shared)} of {int((counts > 0).sum())} training identities "
                         "shared")
        write_exclusions(args.out, Exclusions(classes=shared), header=header)
        print(format_table(results))
        print(f"{len(shared)} training identities listed in {args.out} (train with "
              f"data.exclude={args.out})")
    return 0


def _threshold(args: argparse.Namespace, impostors: list) -> tuple[float, str]:
    """The threshold and one line saying how it was chosen."""
    import numpy as np

    from offline.overlap import calibrated_threshold

    if args.threshold is not None:
        return args.threshold, f"threshold {args.threshold:g} (--threshold)"
    cosines = np.concatenate(impostors) if impostors else np.zeros(0)
    if not len(cosines):
        return DEFAULT_THRESHOLD, (f"threshold {DEFAULT_THRESHOLD:g}: the default (no .bin "
                                   "impostor pairs to calibrate from; --threshold sets it)")
    tau = calibrated_threshold(cosines, args.fmr)
    reached = int((cosines >= tau).sum())
    return tau, (f"threshold {tau:.4f}: the cosine {reached} of the {len(cosines)} impostor "
                 f"pairs of {', '.join(Path(b).stem for b in args.bins)} reach under this "
                 f"model (false-match rate {reached / len(cosines):.2g}, --fmr {args.fmr:g}; "
                 "--threshold sets it instead)")


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
