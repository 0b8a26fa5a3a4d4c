"""Find the training identities that also appear in the evaluation sets, and list them for
``data.exclude``.

Command line (one process, or every rank of torchrun)::

    python -m launch.overlap --checkpoint RUN --data DIR_OR_URL --bins lfw.bin,cfp_fp.bin
        [--ijb IJB_release --ijb-target IJBC] [--rfw RFW_DIR] [--tinyface DIR]
        [--fpir 1e-3 [--held-out LIST | --training-null] | --threshold T] --out overlap.txt
        [--json overlap.json] [--html overlap.html]
    python -m launch.overlap --checkpoint RUN --between A,B [--within]
        [--fpir 0.01 [--held-out LIST_A,LIST_B] | --threshold T] --out merge.txt
        [--json pairs.json] [--html pairs.html]

The second form lists the identities training sets hold twice (``launch.overlap.between``):
each class centre of each set searched against the other sets' centres (``--within``: also
its own set's other centres), the same calibration on the centres of identities the run held
out, the expected number of false pairs beside the count; its list is ``data.merge``'s.

Each training identity's centre (mean unit embedding over its images in DIR's shards; DIR may
be an s3://, gs://, https:// or file:// URL, read as training reads it) is searched for each
evaluation image; the nearest identity is listed when it is within the cosine threshold. The
sets are read as launch.evaluate reads them: .bin files, an IJB-B/C folder, RFW (drawn from
MS-Celeb-1M: it overlaps MS1M training sets) as one .bin per group or its released folder of
images and pair lists, and TinyFace's Testing_Set.

The threshold is calibrated for that search: ``--fpir`` is the share of evaluation images
whose person is not in training that may be listed all the same. It is read off the same
search made by about ``--null-images`` images of the identities the model never saw, each
against the other identities' centres: those the run held out of training (the ``class``
lines of its ``data.exclude``, read from RUN/config.yaml; one line names them), or those of
``--held-out LIST``. A run that held none out is refused, naming the fixes; with
``--training-null`` the training images are searched instead, which a model pulls away from
the other identities, so more than the FPIR is listed (a second line says so;
docs/data.md). It prints the threshold, the searches and identities it was read from, the
rate's band (the identities resampled: an identity's images are one draw) and, per set, the
identities listed beside the number expected falsely; too few searches or identities for the
asked FPIR is refused. ``--threshold`` sets it instead.
Each listed identity is named (DIR's identities.json, written by launch.convert) with the
evaluation image it matched and its own training image nearest that one (shard key and source
path); ``--json`` writes the same rows and the histograms of the nearest-centre cosines and
of the calibration's null, ``--html`` draws them. Train again with ``data.exclude=overlap.txt``
(with ``data.dirs``: run once per folder, one list each). The work is ``offline.overlap``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from data_pipeline.errors import DataError
from data_pipeline.ijb import TARGETS
from launch.cli import checkpoint_program_parser
from launch.overlap import against_eval_sets, between
from offline.overlap.calibration import CalibrationError

DEFAULT_FPIR = 1e-3  # of an evaluation set's images with no mate in training, listed falsely
DEFAULT_NULL_IMAGES = 100_000  # null searches, about (training images' or held-out ones')


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = checkpoint_program_parser("launch.overlap", __doc__)
    p.add_argument("--data",
                   help="the training shard folder, or its URL (s3://, gs://, https://, file://)")
    p.add_argument("--between", metavar="A,B",
                   help="instead of --data and the evaluation sets: shard folders whose "
                   "classes are searched against each other's for one person held twice; "
                   "--out is then a merge list (data.merge)")
    p.add_argument("--within", action="store_true",
                   help="--between: also search each set's classes against its own others")
    p.add_argument("--bins", default="", help="comma-separated verification .bin files")
    p.add_argument("--ijb", type=Path, metavar="DIR",
                   help="IJB_release folder (or its IJBB/IJBC sub-folder holding meta/)")
    p.add_argument("--ijb-target", choices=TARGETS, default="IJBC")
    p.add_argument("--rfw", type=Path, metavar="DIR",
                   help="RFW: one .bin per group (African, Asian, Caucasian, Indian), or the "
                   "released folder (txts/<group>/<group>_pairs.txt and data/)")
    p.add_argument("--tinyface", type=Path, metavar="DIR",
                   help="TinyFace's Testing_Set (or a folder holding it)")
    p.add_argument("--threshold", type=float, default=None,
                   help="cosine between a centre and an image that counts as the same "
                   "identity (default: calibrated at --fpir)")
    p.add_argument("--fpir", type=float, default=DEFAULT_FPIR,
                   help="false-positive identification rate the threshold is set at: the "
                   "share of evaluation images with no mate in training that may be listed "
                   f"(default {DEFAULT_FPIR:g})")
    null = p.add_mutually_exclusive_group()
    null.add_argument("--held-out", type=Path, metavar="LIST",
                      help="an exclusion list the checkpoint was trained with: its classes' "
                      "images, never trained on, are the calibration's probes (default: the "
                      "run's own data.exclude, from RUN/config.yaml)")
    null.add_argument("--training-null", action="store_true",
                      help="calibrate on the training images where the run held no identity "
                      "out: optimistic, more than the FPIR is listed (docs/data.md)")
    p.add_argument("--null-images", type=int, default=DEFAULT_NULL_IMAGES,
                   help="about how many images the calibration searches "
                   f"(default {DEFAULT_NULL_IMAGES:,})")
    p.add_argument("--out", type=Path, required=True, help="the exclusion list to write "
                   "(--between: the merge list)")
    p.add_argument("--json", type=Path, help="also write every shared identity here: set, "
                   "label, identity, score, image, key, source, sample_score; and the "
                   "calibration and histograms")
    p.add_argument("--html", type=Path, help="also write a page with the table and the "
                   "histogram of nearest-centre cosines beside the calibration's null")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    args = p.parse_args(argv)
    if args.threshold is not None and not -1 <= args.threshold <= 1:
        p.error(f"--threshold {args.threshold}: a cosine, in [-1, 1]")
    if not 0 < args.fpir < 1:
        p.error(f"--fpir {args.fpir}: a rate, in (0, 1)")
    return (against_eval_sets if args.between is None else between).checked(p, args)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    mode = against_eval_sets if args.between is None else between  # between: identities held twice
    from trainer import dist

    env = dist.init_distributed(args.device)
    try:
        found = mode.find(args, env)
    except (DataError, CalibrationError) as err:  # the same on every rank: a set or the
        # folder is unreadable, or the null searches do not resolve --fpir
        if env.is_main:
            print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        dist.shutdown()
    if env.is_main:
        mode.report(args, found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
