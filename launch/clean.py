"""List the noisy samples of a data folder with a sub-center run, for ``data.exclude``.

Command line (one process, or every rank of torchrun)::

    python -m launch.clean --checkpoint RUN --data DIR --out noisy.txt [--threshold 75]

DIR may be a URL (s3://bucket/prefix, gs://..., https://...), read as data.dir is.

RUN must have been trained with ``margin.subcenters`` (K > 1) on DIR. Each class's dominant
centre is the one most of its samples are nearest to; a sample whose angle to it exceeds
``--threshold`` degrees (the sub-center ArcFace paper's 75) is listed (``sample KEY`` lines).
Every rank streams its share of DIR's shards once (progress on rank 0). Train again with
``data.exclude=noisy.txt``. The work is ``offline.cleaning``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from data_pipeline.exclusion import Exclusions, made_by, write_exclusions
from data_pipeline.remote import is_url
from launch.cli import checkpoint_program_parser
from offline.cleaning import DEFAULT_THRESHOLD
from trainer.checkpoint import CheckpointError


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = checkpoint_program_parser("launch.clean", __doc__)
    p.add_argument("--data", required=True, help="the shard folder (or its URL) it trained on")
    p.add_argument("--out", type=Path, required=True, help="the exclusion list to write")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help=f"degrees from the dominant centre beyond which a sample is listed "
                   f"(default {DEFAULT_THRESHOLD:g}, the paper's)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    args = p.parse_args(argv)
    if not 0 < args.threshold < 180:
        p.error(f"--threshold {args.threshold}: degrees, in (0, 180)")
    if args.batch_size < 1:
        p.error(f"--batch-size {args.batch_size}: must be >= 1")
    if not is_url(args.data) and not (Path(args.data) / "manifest.json").is_file():
        p.error(f"--data {args.data}: no manifest.json (a folder launch.convert wrote)")
    return args


def load_subcenter_run(path: str | Path):
    """``(backbone in eval mode on the CPU, centres [C, K, D], the run's config)`` of a
    sub-center run's verified checkpoint; collective when a process group is up (the head's
    rows are read with DCP). Raises :class:`CheckpointError` naming the problem."""
    from offline.cleaning import head_centres
    from trainer.checkpoint.backbone import load_backbone, resolve_checkpoint
    from trainer.checkpoint.integrity import verify
    from trainer.checkpoint.layout import read_rows

    backbone, cfg = load_backbone(path)
    k = (cfg.get("margin") or {}).get("subcenters", 1)
    if not isinstance(k, int) or k < 2:
        raise CheckpointError(f"{path}: trained with margin.subcenters={k}: no sub-centers to "
                              "clean with; train with margin.subcenters=3 (the "
                              "glint360k-r100-subcenter recipe) first")
    folder = resolve_checkpoint(path)[1].parent
    verify(folder)  # every file, the head's rows included
    num_classes = (cfg.get("data") or {}).get("num_classes")
    return backbone, head_centres(read_rows(folder, "head.weight"), num_classes), cfg


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    from offline.cleaning import find_noisy
    from trainer import dist

    env = dist.init_distributed(args.device)
    try:
        try:
            backbone, centres, _ = load_subcenter_run(args.checkpoint)
        except CheckpointError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        try:
            result = find_noisy(backbone.to(env.device), centres, args.data, args.threshold,
                                args.batch_size, env.device, env.group, progress=env.is_main)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    finally:
        dist.shutdown()
    if env.is_main:
        header = made_by("launch.clean", {"checkpoint": args.checkpoint, "data": args.data,
                                           "threshold": f"{args.threshold:g} degrees"},
                         f"{len(result.noisy)} of {result.samples} samples listed; "
                         f"dominant-center share {result.dominant_share:.4f}")
        write_exclusions(args.out, Exclusions(samples=result.noisy), header=header)
        print(f"{len(result.noisy)} of {result.samples} samples farther than "
              f"{args.threshold:g} degrees from their class's dominant centre (dominant-center "
              f"share {result.dominant_share:.4f}) listed in {args.out} (train with "
              f"data.exclude={args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
