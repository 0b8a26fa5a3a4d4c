"""Find the training identities that also appear in the evaluation sets, and list them for
``data.exclude``.

Command line (one process, or every rank of torchrun)::

    python -m launch.overlap --checkpoint RUN --data DIR_OR_URL --bins lfw.bin,cfp_fp.bin
        [--ijb IJB_release --ijb-target IJBC] [--rfw RFW_DIR] [--tinyface DIR]
        [--fmr 1e-3 | --threshold T] --out overlap.txt [--json overlap.json]

Each training identity's centre (mean unit embedding over its images in DIR's shards; DIR may
be an s3://, gs://, https:// or file:// URL, read as training reads it) is compared with
every evaluation image; an identity within the cosine threshold of any image is listed. The
sets are read as launch.evaluate reads them: .bin files, an IJB-B/C folder, RFW (drawn from
MS-Celeb-1M: it overlaps MS1M training sets) as one .bin per group or its released folder of
images and pair lists, and TinyFace's Testing_Set.

The threshold comes from the model itself: the cosine that a share ``--fmr`` of the impostor
pairs of the .bins and of RFW (either form) reach (printed with how it was chosen);
``--threshold`` sets it instead (without them it is 0.5). Each listed identity is named (DIR's
identities.json, written by launch.convert) with the evaluation image it matched and its
own training image nearest that one (shard key and source path); ``--json`` writes the same
rows. Train again with ``data.exclude=overlap.txt`` (with ``data.dirs``: run once per folder,
one list each). The work is ``offline.overlap``.
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
from launch.cli import checkpoint_program_parser, load_backbone_or_exit
from offline.overlap import DEFAULT_FMR, DEFAULT_THRESHOLD
from offline.overlap_sets import PairSet, bin_pairs, rfw_folder_pairs

LISTED = 20  # shared identities printed per set; --out and --json hold them all


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = checkpoint_program_parser("launch.overlap", __doc__)
    p.add_argument("--data", required=True,
                   help="the training shard folder, or its URL (s3://, gs://, https://, file://)")
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
                   "identity (default: calibrated at --fmr on the impostor pairs of --bins and "
                   f"--rfw; {DEFAULT_THRESHOLD} without them)")
    p.add_argument("--fmr", type=float, default=DEFAULT_FMR,
                   help="false-match rate of --bins' and --rfw's impostor pairs the threshold "
                   f"is set at (default {DEFAULT_FMR:g})")
    p.add_argument("--out", type=Path, required=True, help="the exclusion list to write")
    p.add_argument("--json", type=Path, help="also write every shared identity here: set, "
                   "label, identity, score, image, key, source, sample_score")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    args = p.parse_args(argv)
    args.bins = [Path(b) for b in args.bins.split(",") if b.strip()]
    if not (args.bins or args.ijb or args.rfw or args.tinyface):
        p.error("nothing to compare with: give --bins, --ijb, --rfw and/or --tinyface")
    for path in args.bins:
        if not path.is_file():
            p.error(f"--bins {path}: no such file ({MISSING_BIN_FIX})")
    if len({b.stem for b in args.bins}) != len(args.bins):
        p.error(f"--bins {','.join(map(str, args.bins))}: two sets with the same file name")
    args.pair_sets = [partial(bin_pairs, b.stem, b) for b in args.bins]
    if args.rfw is not None:
        args.pair_sets += _rfw_groups(p, args.rfw)
    if args.threshold is not None and not -1 <= args.threshold <= 1:
        p.error(f"--threshold {args.threshold}: a cosine, in [-1, 1]")
    if not 0 < args.fmr < 1:
        p.error(f"--fmr {args.fmr}: a rate, in (0, 1)")
    if not is_url(args.data) and not (Path(args.data) / "manifest.json").is_file():
        p.error(f"--data {args.data}: no manifest.json (a folder launch.convert wrote)")
    return args


def _rfw_groups(p: argparse.ArgumentParser, folder: Path) -> list[Callable[[], PairSet]]:
    """RFW's groups in ``RFW_GROUPS`` order, each its ``.bin`` where there is one, else from
    the released folder (``data_pipeline.rfw``), as ``launch.evaluate --rfw`` reads them; a
    parser error names a group that has neither."""
    from data_pipeline.rfw import find_rfw_bin, rfw_image_root
    from partial_fc.eval.fairness import RFW_GROUPS

    images, groups = rfw_image_root(folder), []
    for group in RFW_GROUPS:
        found = find_rfw_bin(folder, group)
        if found is not None:
            groups.append(partial(bin_pairs, f"RFW/{group}", found))
        elif images is not None:
            groups.append(partial(rfw_folder_pairs, images, group))
        else:
            p.error(f"--rfw {folder}: no {group}_test.bin, {group}.bin or "
                    f"txts/{group}/{group}_pairs.txt (RFW needs one of them per group: "
                    f"{', '.join(RFW_GROUPS)})")
    return groups


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    from trainer import dist

    env = dist.init_distributed(args.device)
    try:
        found = _find(args, env)
    except DataError as err:  # the same on every rank: a set or the folder is unreadable
        if env.is_main:
            print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        dist.shutdown()
    if env.is_main:
        _report(args, *found)
    return 0


def _find(args: argparse.Namespace, env) -> tuple:
    """Every rank: the centres, the sets' matches and their nearest training images."""
    from data_pipeline.identities import read_identities
    from data_pipeline.manifest import read_manifest
    from offline.overlap import (
        class_centres,
        impostor_cosines,
        nearest_samples,
        overlap_rows,
        queries,
        set_overlap,
    )
    from offline.overlap_sets import ijb_images, tinyface_images

    manifest = read_manifest(args.data)
    identities = read_identities(args.data, manifest)
    backbone = load_backbone_or_exit(args.checkpoint).to(env.device)
    centres, counts = class_centres(backbone, args.data, args.batch_size, env.device, env.group)
    sets, impostors = [], []
    for read_pairs in args.pair_sets:
        pairs = read_pairs()
        sets.append(pairs.images)
        if args.threshold is None:
            impostors.append((pairs.images.name, impostor_cosines(
                backbone, pairs.encoded, pairs.issame, args.batch_size, env.device)))
    if args.ijb is not None:
        sets.append(ijb_images(args.ijb, args.ijb_target))
    if args.tinyface is not None:
        sets.append(tinyface_images(args.tinyface))
    threshold, how = _threshold(args, impostors)
    if env.is_main:
        print(how)
    results = [set_overlap(images, backbone, centres, threshold, args.batch_size, env.device,
                           env.group) for images in sets]
    nearest = nearest_samples(backbone, args.data, queries(sets, results), args.batch_size,
                              env.device, env.group)
    rows = overlap_rows(sets, results, identities and identities.names, nearest)
    return (threshold, how, identities, manifest.source.get("path"), int((counts > 0).sum()),
            results, rows)


def _report(args: argparse.Namespace, threshold: float, how: str, identities,
            source_root: str | None, trained: int, results: list, rows: list[dict]) -> None:
    """Rank 0: the exclusion list, the JSON, the table and the shared identities."""
    shared = frozenset().union(*(r.classes for r in results))
    header = made_by("launch.overlap", {"checkpoint": args.checkpoint, "data": args.data,
                                         "threshold": f"{threshold:.4g}",
                                         "sets": ",".join(r.name for r in results)},
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
            "threshold": threshold, "threshold_chosen": how,
            "identity_names": None if identities is None else identities.origin,
            "source_root": source_root,
            "sets": [{"name": r.name, "images": r.images, "matched_images": r.matched_images,
                      "shared_identities": len(r.matches)} for r in results],
            "shared": rows}, indent=1) + "\n")
    print(format_table(results))
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


def _threshold(args: argparse.Namespace, impostors: list) -> tuple[float, str]:
    """The threshold and one line saying how it was chosen."""
    import numpy as np

    from offline.overlap import calibrated_threshold

    if args.threshold is not None:
        return args.threshold, f"threshold {args.threshold:g} (--threshold)"
    cosines = np.concatenate([c for _, c in impostors]) if impostors else np.zeros(0)
    if not len(cosines):
        return DEFAULT_THRESHOLD, (f"threshold {DEFAULT_THRESHOLD:g}: the default (no .bin or "
                                   "RFW impostor pairs to calibrate from; --threshold sets it)")
    tau = calibrated_threshold(cosines, args.fmr)
    reached = int((cosines >= tau).sum())
    return tau, (f"threshold {tau:.4f}: the cosine {reached} of the {len(cosines)} impostor "
                 f"pairs of {', '.join(name for name, _ in impostors)} reach under this "
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
