"""``launch.overlap --between A,B [--within]``: the identities training sets hold twice, listed
for ``data.merge`` (the work is ``offline.overlap.pairs``; the page
``offline.overlap.pairs_page``).

Beside ``against_eval_sets``, the other mode of ``launch.overlap``, whose parser, checkpoint,
calibration and refusals it shares: this module checks the flags of that mode, finds the
pairs on every rank and reports them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from data_pipeline.exclusion import made_by
from data_pipeline.merge import content_of, write_merge
from data_pipeline.remote import is_url
from launch.cli import load_backbone_or_exit, resolve_checkpoint_or_exit
from launch.overlap.held_out import held_out_classes
from offline.overlap.calibration import CalibrationError
from offline.overlap.pairs import FoundPairs

LISTED = 20  # pairs printed; --out and --json hold them all


def checked(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` of the between mode, its sets and held-out lists parsed; a parser error
    (one line, exit 2) names a flag of the other mode, a folder without a manifest, or a
    held-out list that cannot be read."""
    other = [flag for flag, value in (("--data", args.data), ("--bins", args.bins),
                                      ("--ijb", args.ijb), ("--rfw", args.rfw),
                                      ("--tinyface", args.tinyface)) if value]
    if args.training_null:
        other.append("--training-null")
    if other:
        p.error(f"--between: the sets are searched against each other; {other[0]} is the "
                "train/test overlap's (run it separately)")
    args.sets = [s.strip() for s in args.between.split(",") if s.strip()]
    if len(args.sets) < 2 and not args.within:
        p.error(f"--between {args.between}: name two sets or more (or one with --within)")
    if len(set(args.sets)) != len(args.sets):
        p.error(f"--between {args.between}: a set named twice")
    for folder in args.sets:
        if not is_url(folder) and not (Path(folder) / "manifest.json").is_file():
            p.error(f"--between: {folder}: no manifest.json (a folder launch.convert wrote)")
    args.held = None
    if args.held_out is not None:
        lists = str(args.held_out).split(",")
        if len(lists) != len(args.sets):
            p.error(f"--held-out {args.held_out}: one list per set of --between (empty for "
                    f"none: --held-out ,held.txt), {len(args.sets)} sets")
        args.held = {i: held_out_classes(p, Path(x)) for i, x in enumerate(lists) if x}
    return args


def _held(args: argparse.Namespace, is_main: bool) -> tuple[dict[int, frozenset[int]], str]:
    """The held-out classes per set (``--held-out``, else what the run of ``--checkpoint``
    held out of each set it trained on) and where they came from; CalibrationError where
    no set has any."""
    if args.held is not None:
        if not args.held:
            raise CalibrationError(f"--held-out {args.held_out}: no list given")
        return args.held, f"--held-out {args.held_out}"
    from offline.overlap.held_out import run_held_out

    config, _ = resolve_checkpoint_or_exit(args.checkpoint)
    held, refusals = {}, []
    for i, folder in enumerate(args.sets):
        try:
            found = run_held_out(config, folder)
        except CalibrationError as err:
            refusals.append(err)
            continue
        held[i] = found.classes
        if is_main:
            print(f"null probes: the centres of the {len(found.classes)} identities held out "
                  f"of training ({found.source}), which the model never saw")
    if not held:
        raise refusals[0]
    return held, "the run's data.exclude"


def find(args: argparse.Namespace, env) -> FoundPairs:
    """Every rank: the centres, the calibration, the pairs (``launch.overlap``'s main runs
    it, and :func:`report` on rank 0)."""
    from data_pipeline.identities import read_identities
    from data_pipeline.manifest import read_manifest
    from offline.overlap.calibration import calibrate, resolvable
    from offline.overlap.centres import class_centres
    from offline.overlap.pairs import (
        CentreSet,
        find_pairs,
        gallery_note,
        nearest_centres,
        null_cosines,
    )

    held, origin = (None, "") if args.threshold is not None else _held(args, env.is_main)
    if held is not None:  # refused before the pass over the shards
        count = sum(map(len, held.values()))
        probes = f"the centres of the {count} identities held out of training ({origin})"
        resolvable(args.fpir, None, count, probes)  # one search by each
    backbone = load_backbone_or_exit(args.checkpoint).to(env.device)
    sets = []
    for folder in args.sets:
        identities = read_identities(folder, read_manifest(folder))
        trained = class_centres(backbone, folder, args.batch_size, env.device, env.group)
        sets.append(CentreSet(folder, trained.centres, trained.counts,
                              identities and identities.names))
    nearest = nearest_centres(sets, args.within, env.group)
    calibration = None
    if held is not None:
        calibration = calibrate(*null_cosines(nearest, held, sets), args.fpir, probes)
    threshold = args.threshold if calibration is None else calibration.threshold
    if env.is_main:
        print(f"threshold {threshold:g} (--threshold)" if calibration is None
              else calibration.describe())
        note = None if held is None else gallery_note(sets, args.within, held)
        if note:
            print(note)
    return FoundPairs(tuple(sets), args.within, threshold, calibration,
                      tuple(find_pairs(nearest, threshold)))


def report(args: argparse.Namespace, found: FoundPairs) -> None:
    """Rank 0: the merge list, the JSON, the page, and the pairs printed."""
    from offline.overlap.pairs_page import pairs_json, write_pairs_page

    sets, pairs, expected = found.sets, found.pairs, found.expected_false
    summary = (f"{len(pairs)} pairs among {found.searches} identities searched"
               + ("" if expected is None else f" (expected false <= {expected:.2g})"))
    settings = {"checkpoint": args.checkpoint, "threshold": f"{found.threshold:.4g}",
                "within": str(found.within).lower()}
    if found.calibration is not None:
        settings["fpir"] = f"{args.fpir:g}"
    lines = [(p.a, p.b, p.score, f"{sets[p.a[0]].describe(p.a[1])} = "
              f"{sets[p.b[0]].describe(p.b[1])}") for p in pairs]
    write_merge(args.out, [s.folder for s in sets], [content_of(s.folder) for s in sets], lines,
                header=made_by("launch.overlap", settings, summary) + "\nstrike a pair that "
                "is two people with a leading '-'; train with data.merge=THIS_FILE")
    if args.json:
        args.json.write_text(json.dumps(pairs_json(args.checkpoint, found), indent=1) + "\n")
    if args.html:
        write_pairs_page(args.html, summary, found)
    for (a, b, score, note) in lines[:LISTED]:
        print(f"{a[0]}:{a[1]} ~ {b[0]}:{b[1]} (cos {score:.3f}): {note}")
    if len(lines) > LISTED:
        print(f"{len(lines) - LISTED} more in {args.out}")
    print(f"{summary}; listed in {args.out} (check them, strike the wrong ones, train with "
          f"data.merge={args.out})")
