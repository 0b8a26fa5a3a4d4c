"""The two ``python -m launch.convert insightface-*`` commands, as functions returning the
lines to print (``launch.convert`` parses the command line and prints them)."""

from __future__ import annotations

from pathlib import Path

import yaml

from offline.insightface.backbones import ImportRefused
from offline.insightface.checkpoint import SHARD
from offline.insightface.config import read_config
from offline.insightface.run import finish_config, import_model, import_run


def convert_checkpoint(src: Path, out: Path, config: Path | None,
                       overrides: list[str]) -> list[str]:
    """An arcface_torch output folder -> a run folder: from its ``checkpoint_gpu_*.pt`` when
    there are any (resumable), else from ``model.pt`` (backbone only)."""
    if not src.is_dir():
        raise ImportRefused(f"{src}: no such folder (give arcface_torch's output folder)")
    if any(SHARD.match(p.name) for p in src.iterdir()):
        return import_run(src, out, config, overrides)
    if (src / "model.pt").is_file():
        return import_model(src, out, config, overrides)
    raise ImportRefused(f"{src}: neither model.pt nor checkpoint_gpu_<rank>.pt (arcface_torch "
                        "writes them into its config's output folder)")


def convert_config(src: Path, out: Path, _config: Path | None,
                   overrides: list[str]) -> list[str]:
    """An arcface_torch config -> a partial-fc YAML recipe holding the converted keys (with
    the overrides), its header listing what had no counterpart and the notes."""
    converted = read_config(src)
    tree = converted.tree
    # validates (a refused value names its file:line); overrides land in the tree
    finish_config(tree, converted.origin, {}, overrides, str(src))
    lines = [f"converted {src} (with configs/base.py beside it, as arcface_torch merges them)"]
    lines += [f"note: {n}" for n in converted.notes]
    lines += [f"no counterpart: {u}" for u in converted.unmapped]
    header = "".join(f"# {line}\n" for line in lines)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + yaml.safe_dump(tree, sort_keys=False))
    # its rec is arcface_torch's .rec folder until converted: the check then needs the shards
    rec = tree.get("data", {}).get("dir")
    converted = rec is None or (Path(rec) / "manifest.json").is_file()
    shards = "" if converted else " data.dir=YOUR_SHARDS"
    return [*lines, f"wrote {out}; check it with: python -m launch.train --config {out}{shards} "
                    "--check"]
