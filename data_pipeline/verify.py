"""`verify`: re-read every shard of a data folder and check it against its manifest.

Per shard: the file exists with the manifest's size, it is a readable tar, it holds exactly
the manifest's sample count, every sample has `jpg` and `cls`, every label is in
[0, num_classes) and every image decodes; its member index, where it has one, is the one its
tar gives. Keys must be unique across the folder.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from data_pipeline.codec import decode_image, resolve_decoder
from data_pipeline.errors import CorruptImageError, ShardError
from data_pipeline.manifest import ShardInfo, read_manifest
from data_pipeline.shard_index import REBUILD, build_index, index_path, read_index, same_index
from data_pipeline.tar_reader import check_shard, tar_samples


@dataclass
class ShardReport:
    """What one shard holds: sample count, keys, corrupt samples and shard-level problems."""

    name: str
    count: int = 0
    keys: list[str] = field(default_factory=list)
    labels: set[int] = field(default_factory=set)
    corrupt: list[str] = field(default_factory=list)  # "shard key (src): reason"
    problems: list[str] = field(default_factory=list)


def verify_shard(path: Path, info: ShardInfo, num_classes: int, decoder: str) -> ShardReport:
    report = ShardReport(info.name)
    try:
        check_shard(path, info)
        for sample in tar_samples(path):
            report.count += 1
            key = sample["__key__"]
            report.keys.append(key)
            src = sample.get("src", b"?").decode(errors="replace")
            try:
                label = int(sample["cls"])
                if not 0 <= label < num_classes:
                    raise ValueError(f"label {label} outside [0, {num_classes})")
                report.labels.add(label)
                decode_image(sample["jpg"], decoder=decoder)
            except (KeyError, ValueError, CorruptImageError) as exc:
                report.corrupt.append(f"{info.name} {key} ({src}): {exc}")
    except ShardError as exc:
        report.problems.append(str(exc))
        return report
    if report.count != info.count:
        report.problems.append(f"{path}: holds {report.count} samples, manifest says {info.count}")
    try:
        index = read_index(path)
        if index is not None and not same_index(index, build_index(path)):
            report.problems.append(f"{index_path(path)}: does not match its shard; {REBUILD}")
    except ShardError as exc:
        report.problems.append(str(exc))
    return report


@dataclass
class VerifyReport:
    num_samples: int
    num_classes: int
    labels_seen: int
    corrupt: list[str]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.corrupt and not self.problems


def verify_dataset(data_dir: str | os.PathLike, *, workers: int = 1, decoder: str = "auto",
                   progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check every shard (in `workers` processes); `progress` gets samples checked per shard."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    decoder = resolve_decoder(decoder)
    jobs = [(data_dir / s.name, s, manifest.num_classes, decoder) for s in manifest.shards]
    reports = []
    with ProcessPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:
        for report in (pool.map if pool else map)(verify_shard, *zip(*jobs, strict=True)):
            reports.append(report)
            if progress:
                progress(report.count)
    problems = [p for r in reports for p in r.problems]
    seen: set[str] = set()
    for report in reports:
        duplicates = seen.intersection(report.keys)
        if duplicates:
            problems.append(f"{data_dir / report.name}: keys {sorted(duplicates)[:5]} "
                            "also appear in an earlier shard")
        seen.update(report.keys)
    total = sum(r.count for r in reports)
    if total != manifest.num_samples and not problems:
        problems.append(f"{data_dir}: {total} samples, manifest says {manifest.num_samples}")
    return VerifyReport(num_samples=total, num_classes=manifest.num_classes,
                        labels_seen=len(set().union(*(r.labels for r in reports))),
                        corrupt=[c for r in reports for c in r.corrupt], problems=problems)
