"""The config schema: the top-level keys and the sections that hold the rest.

Each section is a pydantic model in its own file of :mod:`trainer.config.sections` (every key,
its type, bounds, default and description); :class:`Config` composes them. The models are the
ONLY source of defaults; YAML files hold differences (:mod:`trainer.config.files` reads them).
The ``margin:`` section is one model per ``margin.type``, generated from ``partial_fc.margins``'
registry, and ranges partial_fc states (``head.sample_rate``, the margin keys') are checked by
its rules, in its words. The schema alone refuses unknown keys, a margin key of another type,
wrong types and out-of-range values; what needs several keys is checked in
:mod:`trainer.config.checks`, what needs the data or the machine in
:mod:`trainer.config.resolve`. :mod:`trainer.config.reference` turns the schema into the key
reference ``python -m launch.train --help`` prints, so that reference cannot drift from the
defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field

from partial_fc.margins.registry import DEFAULT_TYPE
from trainer.config.sections.base import NonNegInt, Section
from trainer.config.sections.data import DataConfig
from trainer.config.sections.engine import DistConfig, EngineConfig
from trainer.config.sections.loss import MARGIN_MODELS, DistillConfig, LossConfig, MarginConfig
from trainer.config.sections.model import BackboneConfig, HeadConfig
from trainer.config.sections.optim import OptimConfig, ScheduleConfig, TrainConfig
from trainer.config.sections.run import CheckpointConfig, EvalConfig, LogConfig
from trainer.errors import Refused


class ConfigError(Refused, ValueError):
    """A user error in a config: one line per problem, all problems together (exit 2)."""

    label = "config error"


class ConfigWarning(UserWarning):
    """A config that runs but contradicts the theory (e.g. a scale too small to converge)."""


def _section(model: type[Section], description: str) -> Any:
    """A top-level key holding a whole section (its default: the section's defaults)."""
    return Field(default_factory=model, description=description)


class Config(Section):
    name: str = Field("run", description="run name (W&B, logs, the default output folder)")
    output: str | None = Field(None, description="run folder; null = runs/<name>; a URL "
                               "(s3://, gs://, az://) keeps the run in that object store")
    output_lock: bool = Field(True, description="one job per run folder (a lease object where "
                              "output is a URL); false only where the store ignores "
                              "conditional writes (an emulator) and you make sure of it")
    seed: NonNegInt = Field(0, description="seed of initialisation, sampling and data order")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = cuda when available, else cpu"
    )
    data: DataConfig = _section(DataConfig, "the training data")
    backbone: BackboneConfig = _section(BackboneConfig, "the embedding network")
    margin: MarginConfig = _section(MARGIN_MODELS[DEFAULT_TYPE], "the margin-softmax loss; "
                                    "margin.type picks which keys are read")
    loss: LossConfig = _section(LossConfig, "auxiliary loss terms")
    head: HeadConfig = _section(HeadConfig, "the class-sharded classifier (Partial FC)")
    optim: OptimConfig = _section(OptimConfig, "the optimiser")
    schedule: ScheduleConfig = _section(ScheduleConfig, "the learning-rate schedule")
    train: TrainConfig = _section(TrainConfig, "the training loop")
    engine: EngineConfig = _section(EngineConfig, "backbone replication and precision")
    checkpoint: CheckpointConfig = _section(CheckpointConfig, "saving and resuming")
    log: LogConfig = _section(LogConfig, "metrics, histograms and progress")
    eval: EvalConfig = _section(EvalConfig, "verification during training")
    dist: DistConfig = _section(DistConfig, "the process group")
    distill: DistillConfig = _section(DistillConfig, "distillation from a teacher's embeddings")

    @property
    def run_location(self) -> str:
        """The run folder as given: a path or a URL."""
        return self.output if self.output is not None else f"runs/{self.name}"

    @property
    def run_dir(self) -> Path:
        """The run folder on this machine: for a store URL, this node's copy of it
        (``data_pipeline.store.local_path``), which the run mirrors to the store."""
        from data_pipeline.store import local_path

        return local_path(self.run_location)

    def shown(self, path: Path | str) -> str:
        """``path`` (in :attr:`run_dir`) as the user named the run folder: under its URL for a
        folder in a store, as it is otherwise."""
        return str(path).replace(str(self.run_dir), self.run_location.rstrip("/"), 1)

    def partial_fc_kwargs(self) -> dict[str, Any]:
        """``PartialFC``'s keyword arguments: the head section's, and the margin's
        sub-centers (the weight's shape)."""
        return {**self.head.partial_fc_kwargs(), "subcenters": self.margin.subcenters}

    def margin_kwargs(self) -> dict[str, Any]:
        """The dict for ``partial_fc.build_margin``."""
        return self.margin.model_dump(exclude={"p_w"})


def dump_config(cfg: Config) -> str:
    """The fully resolved config as YAML (what ``RUN/config.yaml`` holds; loadable again)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
