"""``launch.overlap``'s train/test mode: which training identities the evaluation sets share,
listed for ``data.exclude``. This module checks that mode's flags, finds the shared
identities on every rank (``offline.overlap``) and reports them on rank 0; the command line
and its help are ``launch.overlap.__main__``'s.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from data_pipeline.exclusion import Exclusions, made_by, write_exclusions
from data_pipeline.identities import Identities
from data_pipeline.remote import is_url
from data_pipeline.verification_bin import MISSING_BIN_FIX
from launch.cli import load_backbone_or_exit, resolve_checkpoint_or_exit
from launch.overlap.held_out import held_out_classes
from offline.overlap.calibration import Calibration, CalibrationError
from offline.overlap.eval_sets import EvalImages, bin_set, rfw_folder_images
from offline.overlap.matches import SetOverlap

LISTED = 20  # shared identities printed per set; --out and --json hold them all
TRAINED_PROBES = ("note: the model was trained on these probes, so they search the other "
                  "centres at lower cosines than an unseen person and more than the FPIR may be "
                  "listed; identities held out of training (data.exclude, or --held-out LIST) "
                  "read it as asked (docs/data.md)")


@dataclass(frozen=True)
class Found:
    """What every rank found: the ``threshold`` (read off ``calibration``; None:
    ``--threshold``), the folder's ``identities`` map (None: it has none) and ``source_root``
    (the converter's source folder), the ``trained`` identities with an image, each set's
    ``results`` and one row per shared identity (``offline.overlap.matches.overlap_rows``)."""

    threshold: float
    calibration: Calibration | None
    identities: Identities | None
    source_root: str | None
    trained: int
    results: list[SetOverlap]
    rows: list[dict]


def checked(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` of the train/test mode, its sets and held-out list parsed; a parser error
    (one line, exit 2) names a missing --data or set, a .bin that is not there, or a
    held-out list that cannot be read."""
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
    args.held = None if held is None else held_out_classes(p, held)
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


def find(args: argparse.Namespace, env) -> Found:
    """Every rank: the centres, the calibration, the sets' matches and their nearest
    training images (``launch.overlap``'s main runs it, and :func:`report` on rank 0)."""
    from data_pipeline.identities import read_identities
    from data_pipeline.manifest import read_manifest
    from offline.overlap.calibration import calibrate, null_choice
    from offline.overlap.centres import class_centres, null_cosines
    from offline.overlap.eval_sets import ijb_images, tinyface_images
    from offline.overlap.matches import nearest_samples, overlap_rows, queries, set_overlap

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
    return Found(threshold, calibration, identities, manifest.source.get("path"),
                 int((trained.counts > 0).sum()), results, rows)


def report(args: argparse.Namespace, found: Found) -> None:
    """Rank 0: the exclusion list, the JSON, the page, the table and the shared
    identities."""
    from offline.overlap.figure import calibration_json, set_json, write_page

    threshold, calibration, identities = found.threshold, found.calibration, found.identities
    results, rows = found.results, found.rows

    shared = frozenset().union(*(r.classes for r in results))
    settings = {"checkpoint": args.checkpoint, "data": args.data,
                "threshold": f"{threshold:.4g}"}
    if calibration is not None:
        settings["fpir"] = f"{args.fpir:g}"
    header = made_by("launch.overlap", {**settings, "sets": ",".join(r.name for r in results)},
                     f"{len(shared)} of {found.trained} training identities shared")
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
            "source_root": found.source_root,
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
