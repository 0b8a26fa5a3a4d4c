"""Evaluate a backbone: verification ``.bin`` sets (10-fold accuracy, AUC, TAR@FAR),
IJB-B/C 1:1 (TAR@FAR) and 1:N (rank-k, TPIR@FPIR) as insightface's scripts score them,
RFW accuracy by group, TinyFace rank-1/5/20 and MegaFace rank-1 at 10^k distractors.

Command line (one process)::

    python -m launch.evaluate --checkpoint RUN --bin lfw.bin cfp_fp.bin agedb_30.bin
    python -m launch.evaluate --checkpoint RUN --ijb /data/IJB_release --ijb-target IJBC
    python -m launch.evaluate --checkpoint RUN --ijb DIR --ijb-1n --ijb-image-norm kept unit
    python -m launch.evaluate --checkpoint RUN --rfw /data/RFW_bins --tinyface /data/tinyface
    python -m launch.evaluate --checkpoint RUN --megaface /data/megaface_testpack/data

``--rfw`` takes a folder of one ``.bin`` per group (``African.bin`` or ``African_test.bin``,
likewise Asian, Caucasian, Indian) or RFW's released ``test/`` folder (images and
``<group>_pairs.txt``) and adds each group's row and a fairness table (mean, standard
deviation, best-to-worst gap), scored as TFace's verification_rfw.py scores them. IJB rows
are named ``IJBC/1:1/norm-kept`` (insightface's eval_ijbc.py: image features keep their
norm) or ``.../unit-norm`` (each image feature L2-normalised before pooling).

``--log-to-run`` also writes the results into the checkpoint's run (metrics.jsonl, W&B,
TensorBoard) for ``launch.report``'s TAR-FAR curve and RFW bars.

The work is ``trainer.evaluation``; training calls its ``evaluate_bins`` (and
``evaluate_rfw_dir`` for ``eval.rfw``) on every rank.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from data_pipeline.errors import DataError
from data_pipeline.ijb import TARGETS
from data_pipeline.remote import is_url
from data_pipeline.verification_bin import MISSING_BIN_FIX
from launch.cli import (
    checkpoint_program_parser,
    load_backbone_or_exit,
    resolve_checkpoint_or_exit,
)
from partial_fc.eval.fairness import THRESHOLD_RULES
from partial_fc.eval.gallery_search import INDEXES
from partial_fc.eval.ijb import IJB_FARS, IMAGE_NORMS
from partial_fc.eval.ijb_1n import FPIRS
from partial_fc.eval.megaface import MEGAFACE_SIZES
from partial_fc.eval.verification import FARS, resolves
from trainer.checkpoint.meta import checkpoint_step
from trainer.evaluation import (
    evaluate_bins,
    evaluate_ijb_dir,
    evaluate_megaface_dir,
    evaluate_rfw_dir,
    evaluate_tinyface_dir,
)
from trainer.telemetry.evaluation_log import log_to_run


def format_table(results: dict[str, dict[str, float | int]]) -> str:
    """Plain-text table, one row per verification set or IJB target; "-" where n/a. A TAR
    at a FAR the set's impostor pairs cannot resolve (fewer than 1/FAR) is printed with a
    ``*`` and a note under the table."""
    fars = sorted({*FARS, *IJB_FARS})
    ranks = sorted({int(k[4:]) for r in results.values() for k in r if k.startswith("rank")})

    def tar(far: float) -> Callable[[dict], str]:
        def cell(r: dict) -> str:
            exact = resolves(r.get("impostor_pairs", 0), far)
            return f"{100 * r[f'tar@far={far:.0e}']:.2f}" + ("" if exact else "*")
        return cell

    columns = [  # (header, key, format)
        ("pairs", "num_pairs", lambda r: f"{r['num_pairs']}"),
        ("accuracy (%)", "accuracy",
         lambda r: f"{100 * r['accuracy']:.2f} ± {100 * r['accuracy_std']:.2f}"),
        ("threshold", "best_threshold", lambda r: f"{r['best_threshold']:.3f}"),
        ("AUC", "auc", lambda r: f"{r['auc']:.4f}"),
        *((f"TAR@{far:.0e} (%)", f"tar@far={far:.0e}", tar(far)) for far in fars),
        ("probes", "num_probes", lambda r: f"{r['num_probes']}"),
        ("gallery", "gallery_size", lambda r: f"{r['gallery_size']}"),
        *((f"rank-{k} (%)", f"rank{k}", _percent(f"rank{k}")) for k in ranks),
        *((f"TPIR@FPIR={f:.0e} (%)", f"tpir@fpir={f:.0e}", _percent(f"tpir@fpir={f:.0e}"))
          for f in FPIRS),
        ("mean accuracy (%)", "mean", _percent("mean")),
        ("std (%)", "std", _percent("std")),
        ("gap (%)", "gap", _percent("gap")),
        ("worst group", "worst_group", lambda r: r["worst_group"]),
    ]
    columns = [col for col in columns if any(col[1] in r for r in results.values())]
    rows = [["set", *(header for header, _, _ in columns)]]
    for name, r in results.items():
        rows.append([name, *(fmt(r) if key in r else "-" for _, key, fmt in columns)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if any(cell.endswith("*") for row in rows[1:] for cell in row):
        lines.append("* fewer than 1/FAR impostor pairs: the TAR at the nearest FAR they can "
                     "resolve (the IJB protocol's closest-FAR rule), not a measurement at FAR")
    return "\n".join(lines)


def _percent(key: str) -> Callable[[dict], str]:
    return lambda r: f"{100 * r[key]:.2f}"


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = checkpoint_program_parser("launch.evaluate", __doc__)
    p.add_argument("--bin", nargs="+", default=[], metavar="FILE", help="verification .bin sets")
    p.add_argument("--ijb", type=Path, metavar="DIR",
                   help="IJB_release folder (or its IJBB/IJBC sub-folder holding meta/)")
    p.add_argument("--ijb-target", choices=TARGETS, default="IJBC")
    p.add_argument("--ijb-1n", action="store_true",
                   help="also IJB 1:N identification (needs meta/*_1N_*.csv)")
    p.add_argument("--ijb-image-norm", nargs="+", choices=IMAGE_NORMS, default=["kept"],
                   help="kept: image features keep their norm (insightface's eval_ijbc.py); "
                        "unit: each is L2-normalised before pooling; both: one row each")
    p.add_argument("--rfw", type=Path, metavar="DIR",
                   help="RFW: one .bin per group (African, Asian, Caucasian, Indian), or "
                        "the released test/ folder (txts/<group>/<group>_pairs.txt, data/)")
    p.add_argument("--rfw-threshold", choices=THRESHOLD_RULES, default="tface",
                   help="tface: TFace's threshold grid (its numbers); exact: the best "
                        "threshold, as for --bin")
    p.add_argument("--tinyface", type=Path, metavar="DIR",
                   help="TinyFace's Testing_Set (or a folder holding it; with AdaFace's "
                        "aligned_pad_0.1_pad_high/ beside tinyface/, its aligned images): "
                        "rank-1/5/20")
    p.add_argument("--megaface", type=Path, metavar="DIR",
                   help="insightface's MegaFace testsuite data/ folder: rank-1 at 10^k "
                        "distractors")
    p.add_argument("--megaface-sizes", type=int, nargs="+", default=list(MEGAFACE_SIZES),
                   metavar="N", help="distractor counts (the first N of megaface_lst)")
    p.add_argument("--gallery-index", choices=INDEXES, default="flat",
                   help="MegaFace/TinyFace distractor search: flat (exact, the protocols' "
                        "numbers) or ivf (approximate, faster for many probes)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--json", type=Path, help="also write the results to this JSON file")
    p.add_argument("--log-to-run", action="store_true",
                   help="also append the results to the checkpoint's run: a metrics.jsonl "
                        "row at its step, and its W&B / TensorBoard as its config sets them "
                        "(launch.report then draws them)")
    args = p.parse_args(argv)
    if not (args.bin or args.ijb or args.rfw or args.tinyface or args.megaface):
        p.error("nothing to evaluate: give --bin, --ijb, --rfw, --tinyface and/or --megaface")
    for path in args.bin:
        if not Path(path).is_file():
            p.error(f"--bin {path}: no such file ({MISSING_BIN_FIX})")
    if args.log_to_run and is_url(str(args.checkpoint)):
        p.error(f"--log-to-run {args.checkpoint}: a run at a URL is written by its job alone; "
                "keep the results with --json instead")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    backbone = load_backbone_or_exit(args.checkpoint)
    backbone.to(device)
    try:
        results = evaluate_bins(backbone, args.bin, args.batch_size, device)
        if args.rfw is not None:
            results |= evaluate_rfw_dir(backbone, args.rfw, args.batch_size, device,
                                        args.rfw_threshold)
        if args.ijb is not None:
            results |= evaluate_ijb_dir(backbone, args.ijb, args.ijb_target, args.batch_size,
                                        device, progress=True,
                                        image_norms=args.ijb_image_norm, one_to_n=args.ijb_1n)
        if args.tinyface is not None:
            tinyface = evaluate_tinyface_dir(backbone, args.tinyface, args.batch_size, device,
                                             args.gallery_index, progress=True)
            # Published numbers are on aligned images: a row on the raw crops says so.
            results["TinyFace" if tinyface["alignment"] != "none" else
                    "TinyFace/unaligned"] = tinyface
        if args.megaface is not None:
            results |= evaluate_megaface_dir(backbone, args.megaface, args.batch_size, device,
                                             args.megaface_sizes, args.gallery_index,
                                             progress=True)
    except (DataError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # One table per kind: pair verification (.bin, RFW groups, IJB 1:1), identification
    # (IJB 1:N, TinyFace, MegaFace), fairness (RFW).
    tables = [{k: r for k, r in results.items() if key(r)} for key in (
        lambda r: "num_probes" not in r and "gap" not in r, lambda r: "num_probes" in r,
        lambda r: "gap" in r)]
    print("\n\n".join(format_table(t) for t in tables if t))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.log_to_run:
        config, weights = resolve_checkpoint_or_exit(args.checkpoint)
        for line in log_to_run(config.parent, checkpoint_step(weights.parent), results):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
