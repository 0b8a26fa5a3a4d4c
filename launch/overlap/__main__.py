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
import json
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from data_pipeline.errors import DataError
from data_pipeline.exclusion import Exclusions, made_by, write_exclusions
from data_pipeline.ijb import TARGETS
from data_pipeline.remote import is_url
from data_pipeline.verification_bin import MISSING_BIN_FIX
from launch.cli import (
    checkpoint_program_parser,
    load_backbone_or_exit,
    resolve_checkpoint_or_exit,
)
from launch.overlap import between as overlap_between
from offline.overlap.calibration import CalibrationError
from offline.overlap.eval_sets import EvalImages, bin_set, rfw_folder_images

LISTED = 20  # shared identities printed per set; --out and --json hold them all
DEFAULT_FPIR = 1e-3  # of an evaluation set's images with no mate in training, listed falsely
DEFAULT_NULL_IMAGES = 100_000  # null searches, about (training images' or held-out ones')
TRAINED_PROBES = ("note: the model was trained on these probes, so they search the other "
                  "centres at lower cosines than an unseen person and more than the FPIR may be "
                  "listed; identities held out of training (data.exclude, or --held-out LIST) "
                  "read it as asked (docs/data.md)")


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
    if args.between is not None:
        return overlap_between.checked(p, args)
    if args.data is None or args.within:
        p.error("--data: required (or --between A,B [--within] for identities held twice)")
    args.bins = [Path(b) for b in args.bins.split(",") if b.strip()]
    if not (args.bins or args.ijb or args.rfw or args.tinyface):
        p.error("nothing to compare with: give --bins, --ijb, --rfw and/or --tinyface")
    for path in args.bins:
        if not path.is_file():
            p.error(f"--bins {path}: no such file ({MISSING_BIN_FIX})")
    if len({b.stem for b in args.bins}) != len(args.bins):
        p.error(f"--bins {','.join(map(str, args.bins))}: two sets with the same file name")
    args.pair_sets = [partial(bin_set, b.stem, b) for b in args.bins]
    if args.rfw is not None:
        args.pair_sets += _rfw_groups(p, args.rfw)
    if args.null_images < 1:
        p.error(f"--null-images {args.null_images}: at least 1")
    held = args.held_out
    args.held = None if held is None else overlap_between.held_out_classes(p, held)
    if not is_url(args.data) and not (Path(args.data) / "manifest.json").is_file():
        p.error(f"--data {args.data}: no manifest.json (a folder launch.convert wrote)")
    return args


def _null_identities(args: argparse.Namespace, is_main: bool
                     ) -> tuple[frozenset[int] | None, str]:
    """The identities whose images calibrate the threshold, and where they came from:
    ``--held-out``'s, else (no ``--training-null``, no ``--threshold``) those the run held
    out of training, named in one line; None: the training images. CalibrationError where
    the run held none out (``offline.overlap.held_out``)."""
    if args.held is not None:
        return args.held, f"--held-out {args.held_out}"
    if args.training_null or args.threshold is not None:
        return None, ""
    from offline.overlap.held_out import run_held_out

    config, _ = resolve_checkpoint_or_exit(args.checkpoint)
    held = run_held_out(config, args.data)
    if is_main:
        print(held.line())
    return held.classes, held.source


def _rfw_groups(p: argparse.ArgumentParser, folder: Path) -> list[Callable[[], EvalImages]]:
    """RFW's groups in ``RFW_GROUPS`` order, each its ``.bin`` where there is one, else from
    the released folder (``data_pipeline.rfw``), as ``launch.evaluate --rfw`` reads them; a
    parser error names a group that has neither."""
    from data_pipeline.rfw import find_rfw_bin, rfw_image_root
    from partial_fc.eval.fairness import RFW_GROUPS

    images, groups = rfw_image_root(folder), []
    for group in RFW_GROUPS:
        found = find_rfw_bin(folder, group)
        if found is not None:
            groups.append(partial(bin_set, f"RFW/{group}", found))
        elif images is not None:
            groups.append(partial(rfw_folder_images, images, group))
        else:
            p.error(f"--rfw {folder}: no {group}_test.bin, {group}.bin or "
                    f"txts/{group}/{group}_pairs.txt (RFW needs one of them per group: "
                    f"{', '.join(RFW_GROUPS)})")
    return groups


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    find, report = (_find, _report) if args.between is None else (  # identities held twice
        overlap_between.find, overlap_between.report)
    from trainer import dist

    env = dist.init_distributed(args.device)
    try:
        found = find(args, env)
    except (DataError, CalibrationError) as err:  # the same on every rank: a set or the
        # folder is unreadable, or the null searches do not resolve --fpir
        if env.is_main:
            print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        dist.shutdown()
    if env.is_main:
        report(args, *found)
    return 0


def _find(args: argparse.Namespace, env) -> tuple:
    """Every rank: the centres, the calibration, the sets' matches and their nearest
    training images."""
    from data_pipeline.identities import read_identities
    from data_pipeline.manifest import read_manifest
    from offline.overlap.calibration import calibrate, null_choice
    from offline.overlap.eval_sets import ijb_images, tinyface_images
    from offline.overlap.matches import (
        class_centres,
        nearest_samples,
        null_cosines,
        overlap_rows,
        queries,
        set_overlap,
    )

    manifest = read_manifest(args.data)
    identities = read_identities(args.data, manifest)
    sets = [read() for read in args.pair_sets]  # read before the pass over the shards
    if args.ijb is not None:
        sets.append(ijb_images(args.ijb, args.ijb_target))
    if args.tinyface is not None:
        sets.append(tinyface_images(args.tinyface))
    held, origin = _null_identities(args, env.is_main)
    if held is not None and max(held) >= manifest.num_classes:
        raise CalibrationError(f"{origin}: class {max(held)} is not a label of {args.data} "
                               f"({manifest.num_classes} classes)")
    choice = None if args.threshold is not None else null_choice(
        manifest.num_samples, manifest.num_classes, args.null_images, args.fpir, held, origin)
    backbone = load_backbone_or_exit(args.checkpoint).to(env.device)
    trained = class_centres(backbone, args.data, args.batch_size, env.device, env.group,
                            choice)
    calibration = None if choice is None else calibrate(
        *null_cosines(trained, env.device, env.group), args.fpir, choice.probes())
    threshold = args.threshold if calibration is None else calibration.threshold
    if env.is_main:
        print(f"threshold {threshold:g} (--threshold)" if calibration is None
              else calibration.describe())
        if calibration is not None and held is None:
            print(TRAINED_PROBES)
    results = [set_overlap(images, backbone, trained.centres, threshold, args.batch_size,
                           env.device, env.group) for images in sets]
    nearest = nearest_samples(backbone, args.data, queries(sets, results), args.batch_size,
                              env.device, env.group)
    rows = overlap_rows(sets, results, identities and identities.names, nearest)
    return (threshold, calibration, identities, manifest.source.get("path"),
            int((trained.counts > 0).sum()), results, rows)


def _report(args: argparse.Namespace, threshold: float, calibration, identities,
            source_root: str | None, trained: int, results: list, rows: list[dict]) -> None:
    """Rank 0: the exclusion list, the JSON, the page, the table and the shared
    identities."""
    from offline.overlap.figure import calibration_json, set_json, write_page

    shared = frozenset().union(*(r.classes for r in results))
    settings = {"checkpoint": args.checkpoint, "data": args.data,
                "threshold": f"{threshold:.4g}"}
    if calibration is not None:
        settings["fpir"] = f"{args.fpir:g}"
    header = made_by("launch.overlap", {**settings, "sets": ",".join(r.name for r in results)},
                     f"{len(shared)} of {trained} training identities shared")
    by_label: dict[int, list[dict]] = {}
    for row in rows:
        by_label.setdefault(row["label"], []).append(row)
    write_exclusions(args.out, Exclusions(classes=shared), header=header,
                     notes={f"class {label}": _note(mine) for label, mine in by_label.items()})
    names = (f"identity names: {identities.origin}" if identities is not None else
             f"identity names: none ({args.data} was converted before launch.convert wrote "
             "its identities.json; convert it again to name them): listed by label")
    if args.json:
        args.json.write_text(json.dumps({
            "checkpoint": str(args.checkpoint), "data": str(args.data),
            "threshold": threshold, "calibration": calibration_json(calibration),
            "identity_names": None if identities is None else identities.origin,
            "source_root": source_root,
            "sets": [set_json(r, calibration) for r in results],
            "shared": rows}, indent=1) + "\n")
    table = format_table(results, calibration)
    if args.html:
        write_page(args.html, table, threshold, calibration, results)
    print(table)
    print(names)
    for result in results:
        mine = [row for row in rows if row["set"] == result.name]
        for row in mine[:LISTED]:
            print(format_row(row))
        if len(mine) > LISTED:
            print(f"{result.name}: {len(mine) - LISTED} more in {args.json or args.out}")
    print(f"{len(shared)} training identities listed in {args.out} (train with "
          f"data.exclude={args.out})")


def _note(rows: list[dict]) -> str:
    """The exclusion list's note on one identity: its name, and the images it matched."""
    matched = "; ".join(f"{r['set']} {r['image']} {r['score']:.3f}" for r in rows)
    return matched if rows[0]["identity"] is None else f"{rows[0]['identity']}: {matched}"


def format_row(row: dict) -> str:
    """One shared identity: the set and its image, the centre cosine, the identity, and its
    training image nearest that image."""
    who = f"class {row['label']}" + ("" if row["identity"] is None else f" {row['identity']}")
    line = f"{row['set']} {row['image']} ~ {who} (cos {row['score']:.3f})"
    if row["key"] is None:
        return line
    source = row["source"] if row["source"] is not None else "no source path stored"
    return (f"{line}; nearest training image {source} (key {row['key']}, cos "
            f"{row['sample_score']:.3f})")


def format_table(results, calibration) -> str:
    """One row per evaluation set: its images, those matched, the identities it shares and,
    with a calibration, how many of those its FPIR expects falsely (at most: each image with
    no mate lists one identity at most)."""
    rows = [("set", "images", "matched images", "shared identities", "expected false")]
    rows += [(r.name, str(r.images), str(r.matched_images), str(len(r.classes)),
              "-" if calibration is None else f"<= {calibration.expected_fpir * r.images:.2g}")
             for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


if __name__ == "__main__":
    sys.exit(main())
