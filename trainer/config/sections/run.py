"""The sections about what a run leaves behind: ``checkpoint:`` (saving and resuming),
``log:`` (metrics, histograms, progress) and ``eval:`` (verification during training)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainer.config.sections.base import NonNegInt, PosInt, Section


class CheckpointConfig(Section):
    every: NonNegInt = Field(2000, description="steps between checkpoints; 0 = only at the end")
    keep: PosInt = Field(3, description="newest checkpoints kept in RUN/checkpoints")
    resume: str = Field(
        "auto", description="auto (RUN/checkpoints/latest if any), none, or a checkpoint or "
        "run folder to resume from"
    )


class LogConfig(Section):
    every: PosInt = Field(10, description="steps between metric lines (RUN/metrics.jsonl, W&B)")
    hist_every: NonNegInt = Field(
        500, description="steps between target/non-target angle histograms (RUN/histograms.jsonl,"
        " W&B, TensorBoard); 0 = none, and no collective samples them"
    )
    wandb: Literal["offline", "online", "disabled"] = Field(
        "offline", description="Weights & Biases mode (the WANDB_MODE variable overrides it); "
        "offline writes RUN/wandb for a later wandb sync"
    )
    wandb_project: str = Field("partial-fc", description="W&B project name")
    progress: bool = Field(
        True, description="a progress bar when stderr is a terminal; otherwise (and with false) "
        "one plain line every log.every steps"
    )
    tensorboard: bool = Field(
        False, description="also write scalars and histograms to RUN/tb (needs the tensorboard "
        "package: pip install 'partial-fc[tensorboard]')"
    )


class EvalConfig(Section):
    bins: list[str] = Field(
        [], description="verification .bin files (LFW, CFP-FP, ...) evaluated during training "
        "and at the end"
    )
    rfw: str | None = Field(
        None, description="RFW folder of one .bin per group (<group>_test.bin or <group>.bin): "
        "accuracy per group and their spread (TFace's rule), with eval.bins"
    )
    every: PosInt = Field(2000, description="steps between evaluations of eval.bins and eval.rfw")
    batch_size: PosInt = Field(256, description="images per evaluation batch")
