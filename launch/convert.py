"""`python -m launch.convert`: face data sets -> webdataset tar shards, and shard checking.

  python -m launch.convert imagefolder SRC OUT   # SRC/<identity>/<image>, labels by sorted name
  python -m launch.convert insightface SRC OUT   # SRC/train.rec + train.idx (+ property)
  python -m launch.convert verify OUT            # re-read every shard against OUT/manifest.json
  python -m launch.convert index OUT             # (re)write the shards' member indexes
  python -m launch.convert insightface-checkpoint SRC OUT [--config FILE] [key=value ...]
                                                 # an arcface_torch output folder -> a run
  python -m launch.convert insightface-config CONFIG.py OUT.yaml [key=value ...]
                                                 # an arcface_torch config -> a recipe

OUT may be a URL (s3://bucket/prefix, gs://..., file://...; read with fsspec, credentials
from the store's standard places): each shard is uploaded as it is finished and manifest.json
last, so a half-converted prefix is never taken for a whole one. `verify` reads a URL too.
Writing is atomic per shard and resumable: rerun the same command after a crash and finished
shards are kept. Exit status: 0 success, 1 verify found problems, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm import tqdm

from data_pipeline.codec import MAX_PIXELS
from data_pipeline.errors import DataError
from data_pipeline.imagefolder import ImageFolderSource
from data_pipeline.insightface import InsightFaceSource
from data_pipeline.manifest import read_manifest
from data_pipeline.remote import is_url, scrub
from data_pipeline.shard_index import index_folder
from data_pipeline.verify import verify_dataset
from data_pipeline.writer import DEFAULT_SAMPLES_PER_SHARD, write_dataset
from launch.cli import EXIT_STATUS, plain_help
from trainer.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launch.convert",
                                     description=plain_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=EXIT_STATUS)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("imagefolder", "SRC/<identity>/<image> folders"),
                        ("insightface", "insightface train.rec/train.idx/property")):
        sub = commands.add_parser(name, help=f"convert {help_} to shards")
        sub.add_argument("src", metavar="SRC", help="source folder")
        sub.add_argument("out", metavar="OUT", help="output folder (or s3://, gs://, file:// "
                         "URL) for shards + manifest.json")
        sub.add_argument("--samples-per-shard", type=int, default=DEFAULT_SAMPLES_PER_SHARD,
                         help="samples per tar shard (default %(default)s)")
        sub.add_argument("--size", type=int, default=112,
                         help="store SIZE x SIZE images: JPEGs of that size are kept byte for "
                              "byte, others are stretched and re-encoded; 0 keeps every image "
                              "as it is (the loader then stretches at decode time)")
        sub.add_argument("--max-pixels", type=int, default=MAX_PIXELS,
                         help="refuse an image whose header claims more pixels (width x "
                              "height), before decoding it: it is named, stored as is and "
                              "skipped by the loader (default %(default)s)")
        sub.add_argument("--seed", type=int, default=0,
                         help="seed of the order samples are written in (default 0)")
        sub.add_argument("--no-shuffle", action="store_true",
                         help="write samples in source order instead of a seeded random order")
        if name == "imagefolder":
            sub.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                             help="skip files whose path relative to SRC matches this fnmatch "
                                  "pattern (repeatable), e.g. 's10/target.jpg'")
    _insightface_parsers(commands)
    sub = commands.add_parser("verify", help="re-read every shard and check it")
    sub.add_argument("out", metavar="OUT", help="converted folder or its URL (holds "
                     "manifest.json)")
    sub.add_argument("--workers", type=int, default=1, help="processes (default 1)")
    sub.add_argument("--decoder", default="auto", help="auto | simplejpeg | pil")
    sub = commands.add_parser("index", help="(re)write each shard's member index, which the "
                              "loader reads instead of parsing the tar (folders converted "
                              "before indexes existed, or after an index was deleted)")
    sub.add_argument("out", metavar="OUT", help="converted folder (holds manifest.json)")
    sub.add_argument("--workers", type=int, default=1, help="processes (default 1)")
    return parser


def _insightface_parsers(commands) -> None:
    sub = commands.add_parser(
        "insightface-checkpoint", help="an arcface_torch output folder -> a partial-fc run")
    sub.add_argument("src", metavar="SRC", help="arcface_torch output folder: model.pt and/or "
                     "checkpoint_gpu_{rank}.pt")
    sub.add_argument("out", metavar="OUT", help="run folder to write (config.yaml, checkpoints/)")
    sub.add_argument("--config", type=Path, help="its arcface_torch config (.py) or a "
                     "partial-fc YAML recipe")
    sub.add_argument("overrides", nargs="*", metavar="key=value", help="partial-fc config keys")
    sub = commands.add_parser(
        "insightface-config", help="an arcface_torch config (.py, read, not run) -> YAML")
    sub.add_argument("src", metavar="CONFIG", type=Path, help="e.g. configs/wf42m_pfc02_r100.py")
    sub.add_argument("out", metavar="OUT", type=Path, help="YAML recipe to write")
    sub.add_argument("overrides", nargs="*", metavar="key=value", help="partial-fc config keys")


def _insightface(args: argparse.Namespace) -> int:
    from offline.insightface.commands import convert_checkpoint, convert_config

    run = convert_config if args.command == "insightface-config" else convert_checkpoint
    for line in run(Path(args.src), Path(args.out), args.__dict__.get("config"),
                    args.overrides):
        print(line)
    return 0


def _convert(args: argparse.Namespace) -> int:
    if args.command == "imagefolder":
        source = ImageFolderSource(args.src, exclude=args.exclude)
    else:
        source = InsightFaceSource(args.src)
    out = scrub(args.out)
    with tqdm(total=len(source), unit="img", desc=f"{args.command} -> {out}") as bar:
        manifest, corrupt = write_dataset(
            source, args.out, size=args.size or None, samples_per_shard=args.samples_per_shard,
            shuffle_seed=None if args.no_shuffle else args.seed, max_pixels=args.max_pixels,
            progress=bar.update)
    for item in corrupt:
        print(f"warning: {item}: not re-encoded; stored as is, the loader will skip it",
              file=sys.stderr)
    print(f"{out}: {manifest.num_samples} samples, {manifest.num_classes} classes, "
          f"{len(manifest.shards)} shards")
    return 0


def _verify(args: argparse.Namespace) -> int:
    total, out = read_manifest(args.out).num_samples, scrub(args.out)
    with tqdm(total=total, unit="img", desc=f"verify {out}") as bar:
        report = verify_dataset(args.out, workers=args.workers, decoder=args.decoder,
                                progress=bar.update)
    for line in report.problems + [f"corrupt: {c}" for c in report.corrupt]:
        print(line, file=sys.stderr)
    print(f"{out}: {report.num_samples} samples checked, {report.labels_seen} of "
          f"{report.num_classes} classes present, {len(report.corrupt)} corrupt images, "
          f"{len(report.problems)} shard problems: {'OK' if report.ok else 'FAILED'}")
    return 0 if report.ok else 1


def _index(args: argparse.Namespace) -> int:
    if is_url(args.out):
        raise DataError(f"{scrub(args.out)}: index writes into a local folder; a conversion "
                        "into a URL writes the indexes itself")
    total = read_manifest(args.out).num_samples
    with tqdm(total=total, unit="img", desc=f"index {args.out}") as bar:
        shards = index_folder(args.out, workers=args.workers, progress=bar.update)
    print(f"{args.out}: {shards} shards indexed")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command.startswith("insightface-"):
            return _insightface(args)
        return {"verify": _verify, "index": _index}.get(args.command, _convert)(args)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except UserError as exc:
        print(f"{exc.label}: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
