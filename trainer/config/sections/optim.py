"""The ``optim:``, ``schedule:`` and ``train:`` sections: the optimiser, its learning-rate
schedule, and the loop's batches, length and gradient safeguards."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from trainer.config.sections.base import NonNegFloat, PosFloat, PosInt, Section, UnitFloat


class OptimConfig(Section):
    name: Literal["sgd", "adamw"] = Field(
        "sgd", description="optimiser of backbone (torch's SGD / AdamW, decoupled decay) and "
        "head (its row-sampling twin: partial_fc.optim)"
    )
    lr: PosFloat = Field(0.1, description="peak learning rate (after warm-up)")
    momentum: UnitFloat = Field(0.9, description="sgd momentum")
    weight_decay: NonNegFloat = Field(5e-4, description="weight decay (decoupled for adamw)")
    betas: Annotated[list[UnitFloat], Field(min_length=2, max_length=2)] = Field(
        [0.9, 0.999], description="adamw: the two moment decay rates"
    )
    eps: PosFloat = Field(1e-8, description="adamw: denominator epsilon")
    decay: Literal["all", "weights"] = Field(
        "all", description="backbone weight decay on all parameters, or on weights only: not "
        "norms, biases, PReLU slopes, position embeddings (the ViT setting); head: always"
    )


class ScheduleConfig(Section):
    type: Literal["poly", "cosine"] = Field(
        "poly", description="learning-rate decay after warm-up, to 0 at the last step"
    )
    warmup_epochs: NonNegFloat = Field(
        0.0, description="epochs of linear warm-up from 0 to optim.lr"
    )
    power: PosFloat = Field(2.0, description="poly only: lr * (1 - t/T)^power")


class TrainConfig(Section):
    batch_size: PosInt = Field(128, description="images per rank per micro-batch")
    epochs: PosInt = Field(20, description="passes over the data")
    max_steps: PosInt | None = Field(
        None, description="stop (and end the LR schedule) after this many steps; null = epochs"
    )
    grad_accum: PosInt = Field(
        1, description="micro-batches per rank per optimisation step (exact only for a "
        "full-softmax, fixed-scale, non-SphereFace head); not with train.global_batch"
    )
    global_batch: PosInt | None = Field(
        None, description="images per optimisation step, all ranks together: train.batch_size "
        "is then the micro-batch and each of P ranks runs global_batch / (batch_size x P) of "
        "them, derived at every start and resume; null = batch_size x grad_accum x P"
    )
    clip_grad_norm: PosFloat | None = Field(
        5.0, description="clip the backbone's gradient norm to this; null disables"
    )

    # A step with a non-finite loss or gradient is skipped on every rank (trainer.engine);
    # this many in a row end the run with an error (the model is diverging).
    max_bad_steps: PosInt = Field(
        10, description="consecutive non-finite (skipped) steps after which the run stops"
    )
