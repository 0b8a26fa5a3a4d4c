"""A teacher's embeddings of every training sample, for offline distillation.

    python -m launch.embed --checkpoint TEACHER --data DIR --out DIR2
    python -m launch.torchrun --nproc_per_node 8 -m launch.embed --checkpoint ... (all ranks)
    python -m launch.embed --verify --data DIR --out DIR2

TEACHER is a partial-fc run (``RUN``, ``RUN/checkpoints/<tag>``, its ``backbone.pt``; an
arcface_torch run converted by ``launch.convert insightface-checkpoint`` is one) or an ``.onnx``
file (run through ONNX Runtime). DIR2 gets one ``.npz`` per shard of DIR, keyed by the
samples' keys (``trainer.teacher_embeddings``), with the embedding of each image and of its
mirror (``--no-flip``: the image's alone, for a run with ``data.flip=false``). Under torchrun
each rank embeds every WORLD_SIZE-th shard. Run it again to resume: finished shards are
kept. ``--verify`` checks that every sample of DIR has its embedding; training with
``distill.embeddings=DIR2`` then reads them instead of running the teacher.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from data_pipeline.errors import DataError
from data_pipeline.remote import is_url
from launch.cli import EXIT_STATUS, plain_help
from offline.embedding_sets import embed_shards, verify
from trainer.dist import init_distributed, shutdown
from trainer.distill import TeacherError, load_teacher


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.embed", description=plain_help(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=EXIT_STATUS)
    p.add_argument("--checkpoint", help="TEACHER: RUN, RUN/checkpoints/<tag>, its backbone.pt, "
                   "or an .onnx file")
    p.add_argument("--data", required=True, type=Path, help="shard folder (with manifest.json)")
    p.add_argument("--out", required=True, type=Path, help="folder of the embeddings")
    p.add_argument("--no-flip", action="store_true", help="skip the mirrored images' views")
    p.add_argument("--batch-size", type=int, default=64, help="images per teacher forward")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--verify", action="store_true",
                   help="check DIR2 against DIR instead of embedding")
    args = p.parse_args(argv)
    try:
        if args.verify:
            return _report(verify(args.data, args.out), args)
        if args.checkpoint is None:
            p.error("--checkpoint TEACHER is required (unless --verify)")
        env = init_distributed(args.device)
        try:
            teacher = load_teacher(args.checkpoint)
            # a resume from elsewhere matches (a URL names itself)
            name = args.checkpoint if is_url(args.checkpoint) else \
                str(Path(args.checkpoint).resolve())
            written = embed_shards(teacher, name, args.data, args.out, flip=not args.no_flip,
                                   rank=env.rank, world_size=env.world_size,
                                   batch_size=args.batch_size, device=env.device)
            if env.world_size > 1:
                dist.barrier()
            if env.is_main:
                tqdm.write(f"wrote {len(written)} shard(s) of {args.data} on rank 0 "
                           f"({env.world_size} rank(s)) into {args.out}")
                return _report(verify(args.data, args.out), args)
            return 0
        finally:
            shutdown()
    except (DataError, TeacherError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _report(problems: list[str], args) -> int:
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if not problems:
        print(f"{args.out}: every sample of {args.data} has its teacher embedding")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
