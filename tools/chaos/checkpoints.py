"""``make chaos`` rows that break a checkpoint or the disk under it: a planted pickle, a
flipped bit, a kill inside a replacement, a dangling ``latest``, a full disk, a resume under
another margin, and the BatchNorm copy a checkpoint holds twice (listed in
``tools/chaos/cases.py``)."""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
from pathlib import Path

from tools.testbed.harness import Result, train, wait_for_step, wait_until


def _two_checkpoints(data: Path, work: Path) -> Result:
    return train(data, work / "run", "train.max_steps=4")


def planted_pickle(data: Path, work: Path) -> tuple[str, bool]:
    first = _two_checkpoints(data, work)
    marker = work / "pwned"
    (work / "run" / "checkpoints" / "step-00000004" / "state" / ".metadata").write_bytes(
        pickle.dumps(_Planted(str(marker))))
    r = train(data, first.run)
    fell_back = "resumed from" in r.out and "step-00000002" in r.out
    named = ".metadata: SHA-256 differs" in r.out
    ran = marker.exists()
    return f"rc {r.rc}, warning names .metadata: {named}, resumed from step 2: {fell_back}, " \
           f"payload ran: {ran}", r.rc == 0 and named and fell_back and not ran


class _Planted:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def bit_flip(data: Path, work: Path) -> tuple[str, bool]:
    first = _two_checkpoints(data, work)
    (part,) = (first.run / "checkpoints" / "step-00000004" / "state").glob("*.distcp")
    raw = bytearray(part.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 400] = bytes(b ^ 0x55 for b in raw[len(raw) // 2 :][:400])
    part.write_bytes(bytes(raw))
    r = train(data, first.run)
    named = f"{part.name}: SHA-256 differs" in r.out
    fell_back = "resumed from" in r.out and "step-00000002" in r.out
    return f"rc {r.rc}, warning names {part.name}: {named}, resumed from step 2: {fell_back}", \
        r.rc == 0 and named and fell_back


def kill_in_replace(data: Path, work: Path) -> tuple[str, bool]:
    first = _two_checkpoints(data, work)
    # A fresh run in the same folder re-saves step 2 over the old one and dies in between.
    killed = train(data, first.run, "checkpoint.resume=none", "train.max_steps=4",
                   inject=["kill-in-replace"])
    target = killed.latest()
    r = train(data, first.run, "train.max_steps=4")
    return f"killed rc {killed.rc}, latest -> {target}, restart rc {r.rc}, resumed: " \
           f"{'resumed from' in r.out}", killed.rc == -9 and r.rc == 0 and "resumed from" in r.out


def broken_latest(data: Path, work: Path) -> tuple[str, bool]:
    first = _two_checkpoints(data, work)
    root = first.run / "checkpoints"
    (root / "latest").write_text("step-00000099\n")
    meta = root / "step-00000004" / "meta.json"
    meta.write_text(meta.read_text()[:50])
    stale = root / ".tmp-step-00000006"
    stale.mkdir()
    r = train(data, first.run)
    warned = "does not name a usable checkpoint" in r.out and "meta.json: unreadable" in r.out
    resumed = "resumed from" in r.out and "step-00000002" in r.out
    return f"rc {r.rc}, warnings: {warned}, resumed from step 2: {resumed}, stale .tmp " \
           f"removed: {not stale.exists()}", r.rc == 0 and warned and resumed and not stale.exists()


def disk_full(data: Path, work: Path) -> tuple[str, bool]:
    r = train(data, work / "run", inject=["disk-full-at-2"])
    errors = r.errors()
    named = len(errors) == 1 and "(ENOSPC)" in errors[0]
    leftovers = sorted(p.name for p in (r.run / "checkpoints").iterdir())
    holds = r.rc == 1 and named and leftovers == ["latest", "step-00000002"]
    return f"rc {r.rc}, ENOSPC named in one line: {named}, left: {', '.join(leftovers)}", holds


def run_folder_fills_up(data: Path, work: Path) -> tuple[str, bool]:
    """A real full filesystem: the run folder on a 64 MiB tmpfs that another writer fills
    once the first checkpoint exists (needs root to mount; said so where refused)."""
    disk = work / "disk"
    disk.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        return "skipped: mount -t tmpfs refused (needs root)", True

    def fill_after_first_checkpoint(proc: subprocess.Popen) -> None:
        wait_for_step(disk / "run", 2, proc)
        wait_until(lambda: any((disk / "run" / "checkpoints").glob("step-*")), proc=proc,
                   every=0.05)
        with open(disk / "filler", "ab") as filler, contextlib.suppress(OSError):
            while True:
                filler.write(b"\0" * 2**20)
                filler.flush()

    try:
        r = train(data, disk / "run", "train.max_steps=400", "checkpoint.every=2",
                  until=fill_after_first_checkpoint)
        errors = r.errors()
        latest = r.latest()
        from trainer import checkpoint
        verifies = latest is not None and bool(checkpoint.verify(r.run / "checkpoints" / latest))
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    holds = r.rc == 1 and len(errors) == 1 and str(disk) in errors[0] and verifies
    return f"rc {r.rc}, one line naming the file: {len(errors) == 1}, latest {latest} " \
           f"verifies: {verifies}", holds


def config_drift(data: Path, work: Path) -> tuple[str, bool]:
    first = _two_checkpoints(data, work)
    r = train(data, first.run, "margin.type=arcface", "margin.m=0.5")
    errors = r.errors()
    holds = r.rc == 2 and len(errors) == 1 and "margin.type 'cosface' -> 'arcface'" in errors[0]
    return f"rc {r.rc}, {len(errors)} line(s): {errors[0][:90] if errors else r.out[-200:]}", holds



def batchnorm_copies_agree(data: Path, work: Path) -> tuple[str, bool]:
    r = train(data, work / "run", "train.max_steps=2", ranks=2)
    folder = r.run / "checkpoints" / "step-00000002"
    exported, stored = backbone_pt_and_dcp(folder)
    keys = [k for k in exported if "running" in k]
    worst = max(float((exported[k] - stored[k]).abs().max()) for k in keys) if keys else None
    return f"rc {r.rc}, {len(keys)} BatchNorm buffers, largest backbone.pt vs DCP " \
           f"difference {worst}", r.rc == 0 and bool(keys) and worst == 0.0


def backbone_pt_and_dcp(folder: Path) -> tuple[dict, dict]:
    import torch
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.integrity import SafeReader

    exported = torch.load(folder / "backbone.pt", weights_only=True)
    reader = SafeReader(folder / "state")
    metadata = reader.read_metadata().state_dict_metadata
    template = {f"backbone.{k}": torch.zeros(metadata[f"backbone.{k}"].size,
                                             dtype=metadata[f"backbone.{k}"].properties.dtype)
                for k in exported}
    dcp.load(template, storage_reader=reader, no_dist=True)
    return exported, {k[len("backbone."):]: v for k, v in template.items()}
