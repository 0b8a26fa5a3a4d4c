"""`verify`: re-read every shard of a data folder and check it against its manifest.

Per shard: the file exists with the manifest's size, it is a readable tar, it holds exactly
the manifest's sample count, every sample has `jpg` and `cls`, every label is in
[0, num_classes) and every image decodes; its member index, where it has one, is the one its
tar gives. Keys must be unique across the folder, and the label-to-identity map the manifest
names (data_pipeline.identities) must hold one name per class. A folder at a URL is checked
the same way, one shard at a time copied to a temporary file
(data_pipeline.remote_shards.local_copy).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from data_pipeline.codec import decode_image, resolve_decoder
from data_pipeline.errors import CorruptImageError, DataError, ShardError
from data_pipeline.identities import read_identities
from data_pipeline.manifest import ShardInfo, read_manifest
from data_pipeline.remote import RemoteFolder, open_folder
from data_pipeline.remote_shards import local_copy
from data_pipeline.shard_index import (
    INDEX_SUFFIX,
    REBUILD,
    build_index,
    index_path,
    read_index,
    same_index,
)
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


def _verify_in(folder: Path | RemoteFolder, info: ShardInfo, num_classes: int, decoder: str,
               stored: dict[str, int] | None) -> ShardReport:
    """:func:`verify_shard` of shard ``info`` of ``folder``: in place in a local folder, else
    on a temporary copy (``stored``: the sizes of the folder's files at the URL), its
    problems naming the URL."""
    if stored is None:
        return verify_shard(folder / info.name, info, num_classes, decoder)
    where = f"{folder.shown}/{info.name}"
    if stored.get(info.name) != info.bytes:
        size = stored.get(info.name)
        return ShardReport(info.name, problems=[f"{where}: " + (
            "missing" if size is None else f"{size} bytes, manifest says {info.bytes}")])
    with local_copy(folder, info.name, info.bytes, info.name + INDEX_SUFFIX in stored) as path:
        report = verify_shard(path, info, num_classes, decoder)
    report.problems = [p.replace(str(path), where) for p in report.problems]
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
    """Check every shard of ``data_dir`` (a folder or a URL) in `workers` processes;
    `progress` gets samples checked per shard."""
    folder = open_folder(data_dir)
    manifest = read_manifest(folder)
    decoder = resolve_decoder(decoder)
    stored = None
    if isinstance(folder, RemoteFolder):  # one listing: what is there, and its sizes
        names = [s.name for s in manifest.shards]
        stored = folder.sizes(names + [n + INDEX_SUFFIX for n in names])
    jobs = [(folder, s, manifest.num_classes, decoder, stored) for s in manifest.shards]
    data_dir = folder if isinstance(folder, Path) else folder.shown
    reports = []
    with ProcessPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:
        for report in (pool.map if pool else map)(_verify_in, *zip(*jobs, strict=True)):
            reports.append(report)
            if progress:
                progress(report.count)
    problems = [p for r in reports for p in r.problems]
    try:
        read_identities(folder, manifest)
    except DataError as exc:
        problems.append(str(exc))
    seen: set[str] = set()
    for report in reports:
        duplicates = seen.intersection(report.keys)
        if duplicates:
            problems.append(f"{data_dir}/{report.name}: keys {sorted(duplicates)[:5]} "
                            "also appear in an earlier shard")
        seen.update(report.keys)
    total = sum(r.count for r in reports)
    if total != manifest.num_samples and not problems:
        problems.append(f"{data_dir}: {total} samples, manifest says {manifest.num_samples}")
    return VerifyReport(num_samples=total, num_classes=manifest.num_classes,
                        labels_seen=len(set().union(*(r.labels for r in reports))),
                        corrupt=[c for r in reports for c in r.corrupt], problems=problems)
