"""Evaluation results as run metrics: ``val/<set>/<metric>`` keys, the form training's
evaluations take in ``metrics.jsonl``, W&B and TensorBoard, and their way back.

A set's name may hold slashes (``IJBC/1:1/norm-kept``, ``RFW/African``); a metric's never
does (``accuracy``, ``tar@far=1e-04``), so the last slash splits a key back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from data_pipeline.door import read_text
from trainer.config.sections.run import LogConfig
from trainer.telemetry import run_files
from trainer.telemetry.sinks import Sink, TensorBoardSink, WandbSink
from trainer.yaml_file import MAX_BYTES, WHAT, YamlRefused, parse_yaml

PREFIX = "val/"


def flat_metrics(results: Mapping[str, Mapping[str, object]]) -> dict[str, float | int]:
    """``{set: {metric: value}}`` -> ``{"val/<set>/<metric>": value}``, numbers only (a
    group's name or a rule's is not a metric)."""
    return {f"{PREFIX}{name}/{key}": value for name, metrics in results.items()
            for key, value in metrics.items()
            if isinstance(value, int | float) and not isinstance(value, bool)}


def nested_metrics(row: Mapping[str, object]) -> dict[str, dict[str, float]]:
    """The inverse of :func:`flat_metrics` for one metrics row (other keys ignored)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in row.items():
        if key.startswith(PREFIX) and "/" in key[len(PREFIX):]:
            name, _, metric = key[len(PREFIX):].rpartition("/")
            out.setdefault(name, {})[metric] = value
    return out


def log_to_run(run_dir: Path, step: int,
               results: Mapping[str, Mapping[str, object]]) -> list[str]:
    """Append one ``metrics.jsonl`` row at ``step`` (the checkpoint's) and send it to the
    W&B run and TensorBoard files the run's ``config.yaml`` switches on (``log.wandb``, the
    ``WANDB_MODE`` variable, ``log.tensorboard``). Not while a training job writes the folder.

    Returns:
        The sinks' "what to run next" lines (e.g. ``wandb sync ...``).
    """
    config_text = read_text(run_dir / "config.yaml", WHAT, limit=MAX_BYTES, error=YamlRefused)
    config = parse_yaml(config_text, str(run_dir / "config.yaml")) or {}  # before any write
    values = flat_metrics(results)
    with (run_dir / run_files.METRICS).open("a") as metrics:
        metrics.write(json.dumps({"step": step, **values}) + "\n")
    log = LogConfig.model_validate(config.get("log") or {})
    sinks: list[Sink] = []
    mode = os.environ.get("WANDB_MODE") or log.wandb
    if mode != "disabled":
        sinks.append(WandbSink(run_dir, mode, log.wandb_project, config.get("name", "run"),
                               config))
    if log.tensorboard:
        sinks.append(TensorBoardSink(run_dir, config_text, 0))  # 0: hide no later events
    for sink in sinks:
        sink.scalars(step, values)
        sink.close({"evaluation_step": step})
    return [sink.next_step() for sink in sinks]
