"""Training configuration: :func:`load_config`, the one entry point, and the names callers use.

Loading is three jobs, each its own module: :mod:`trainer.config.files` reads the recipe
(``base:`` chain, ``dotted.key=value`` overrides) and records which file set each key;
:mod:`trainer.config.schema` validates it against the typed schema (one file per section in
:mod:`trainer.config.sections`), the only source of defaults; :mod:`trainer.config.checks`
(and :mod:`trainer.config.resolve`, :mod:`trainer.config.resume_drift`) runs the checks the
schema cannot express, pure functions of the config, the data's manifest and a
:class:`Machine` snapshot. This module composes them so that every problem found is reported
at once, in one :class:`ConfigError`, one line each, naming the file (or ``command line``) that
set the key, the key, the value and the valid choices. With ``resolve=True`` the checks also
read what is on disk (:mod:`trainer.config.on_disk`: ``manifest.json``, the paths the run
opens) and look at the machine (:meth:`Machine.observe` unless one is given), so a run fails
before any process group starts.

The rest of ``launch`` (and bench/, tests/) imports configuration names from here.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from pydantic import ValidationError

from trainer.config.checks import semantic_errors, theory_warnings
from trainer.config.files import (
    apply_overrides,
    load_tree,
    margin_type,
    retype_margin,
    schema_errors,
    shown,
    source_of,
)
from trainer.config.machine import Machine
from trainer.config.on_disk import path_errors, read_data_manifest, with_merge_digest
from trainer.config.pace import cpu_pace_warning
from trainer.config.reference import describe_keys
from trainer.config.resolve import Resolved, resolve_config
from trainer.config.resume_drift import resume_drift
from trainer.config.schema import Config, ConfigError, ConfigWarning, dump_config
from trainer.config.sections.data import DataConfig
from trainer.config.sections.engine import DistConfig, EngineConfig
from trainer.config.sections.loss import MARGIN_MODELS, DistillConfig, MarginConfig
from trainer.config.sections.model import BackboneConfig, HeadConfig
from trainer.config.sections.optim import OptimConfig, ScheduleConfig, TrainConfig
from trainer.config.sections.run import CheckpointConfig, EvalConfig, LogConfig

# A recipe of 10,000 wrong values (the YAML reader's bound) is not read line by line.
MAX_LINES = 30

__all__ = [
    "BackboneConfig", "CheckpointConfig", "Config", "ConfigError", "ConfigWarning", "DataConfig",
    "DistConfig", "DistillConfig", "EngineConfig", "EvalConfig", "HeadConfig", "LogConfig",
    "MARGIN_MODELS", "MAX_LINES", "Machine",
    "MarginConfig", "OptimConfig", "Resolved", "ScheduleConfig", "TrainConfig", "describe_keys",
    "dump_config", "load_config", "machine_notes", "resolve_config", "resolve_here",
    "resume_drift", "run_folder", "theory_warnings",
]


def resolve_here(cfg: Config, machine: Machine | None = None) -> Resolved:
    """:func:`resolve_config` over what is on disk (``data.dir``'s manifest, the paths the run
    opens) and ``machine`` (:meth:`Machine.observe` when None): the config with the data's
    sizes filled, and every (dotted key, message) the data, the files and the machine refuse.
    ``cfg`` itself is left as it was."""
    manifest, found = read_data_manifest(cfg)
    filled, more = resolve_config(cfg, manifest, machine or Machine.observe())
    filled, merged = with_merge_digest(filled)
    return Resolved(filled, found + more + merged + path_errors(cfg))


def machine_notes(cfg: Config, machine: Machine | None = None) -> tuple[Config, list[str]]:
    """The data and machine checks of ``load_config(..., resolve=True)`` for a config loaded
    with ``resolve=False`` (``--print-config`` before the data exists): a copy of ``cfg`` with
    ``data.num_classes/num_samples`` filled where the manifest is there, and the refusals as
    lines. The theory checks run on the copy (their :class:`ConfigWarning` raised here, as
    ``load_config`` does)."""
    filled, found = resolve_here(cfg, machine)
    for msg in theory_warnings(filled):
        warnings.warn(msg, ConfigWarning, stacklevel=2)
    return filled, [msg for _, msg in found]


def run_folder(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> str | None:
    """The run folder ``path`` plus ``overrides`` names (``output``, else ``runs/<name>``: a
    path or a URL), read from the merged YAML without validating the rest: a launcher reports
    a failed rank's log there even when the config was refused. None when the recipe cannot
    be read."""
    try:
        tree = load_tree(Path(path), {})
    except (ConfigError, OSError):
        return None
    apply_overrides(tree, list(overrides), {})
    fields = Config.model_fields
    output = tree.get("output", fields["output"].default)
    name = tree.get("name", fields["name"].default)
    return str(output) if output is not None else f"runs/{name}"


def load_config(
    path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    resolve: bool = True,
    machine: Machine | None = None,
) -> Config:
    """Load ``path`` (with its ``base:`` chain), apply ``key=value`` overrides, validate.

    ``resolve=True`` (what ``launch.train`` does, before any process group) also reads
    ``data.dir/manifest.json`` to fill/check ``num_classes``/``num_samples`` (with
    ``data.source=synthetic``: no file; ``num_samples`` from the synthetic settings), checks the
    device, resume folder and eval files, against ``machine`` (the launch's ranks, GPUs,
    packages; :meth:`Machine.observe` when None). Theory checks (known C) and a step that
    would take minutes on this machine's CPU become :class:`ConfigWarning`.
    Raises :class:`ConfigError` listing every problem found.
    """
    origin: dict[str, str] = {}
    top = shown(Path(path))
    tree = load_tree(Path(path), origin)
    recipe_type = margin_type(tree)
    errors = apply_overrides(tree, list(overrides), origin)
    retyped = retype_margin(tree, origin, recipe_type)
    broken: set[str] = set()
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:
        errors += schema_errors(e, origin, top)
        # Keep checking what did validate: broken top-level keys fall back to defaults and
        # the checks below report nothing about them.
        broken = {str(err["loc"][0]) for err in e.errors() if err["loc"]}
        cfg = Config.model_validate({k: v for k, v in tree.items() if k not in broken})
    found = semantic_errors(cfg)
    pace: list[str] = []
    if resolve:
        machine = machine or Machine.observe()
        cfg, more = resolve_here(cfg, machine)
        found += more
        pace = [msg for msg in [cpu_pace_warning(cfg, machine)] if msg]
    errors += [
        f"{source_of(origin, key, top)}: {msg}"
        for key, msg in found
        if key.split(".")[0] not in broken
    ]
    if errors:
        listed = errors[:MAX_LINES] + [f"({len(errors) - MAX_LINES} more problems not shown)"] \
            * (len(errors) > MAX_LINES)
        raise ConfigError("\n".join(listed))
    for msg in [retyped] * bool(retyped) + theory_warnings(cfg) + pace:
        warnings.warn(msg, ConfigWarning, stacklevel=2)
    return cfg

