"""How many micro-batches one optimisation step runs on each rank, from the recipe and the
world size.

Two recipes. ``train.grad_accum`` (default 1) fixes the passes per rank ``k``, so a step holds
``batch_size x k x P`` images and follows the world size ``P``. ``train.global_batch`` fixes
the step instead (DESIGN.md invariant 9): ``B`` images, ``n = B / b`` micro-batches of
``b = train.batch_size``, of which each of the ``P`` ranks runs ``k = n / P``; ``k`` is derived
here at every start and resume, so a run resumed on other ranks keeps its step. The two keys
are not combined (a recipe gives ``global_batch`` or ``grad_accum``). Pure: the world size is
an argument.
"""

from __future__ import annotations

from trainer.config.sections.optim import TrainConfig


def micro_batches(train: TrainConfig) -> int | None:
    """``n = global_batch / batch_size``, the micro-batches of one step (all ranks); None
    without ``train.global_batch``. The check refuses a ``global_batch`` that ``batch_size``
    does not divide."""
    if train.global_batch is None:
        return None
    return train.global_batch // train.batch_size


def accumulation(train: TrainConfig, world_size: int) -> int:
    """The micro-batches each rank runs per step: ``n / P`` with ``train.global_batch``,
    else ``train.grad_accum``."""
    n = micro_batches(train)
    return train.grad_accum if n is None else n // world_size


def images_per_step(train: TrainConfig, world_size: int) -> int:
    """Images of one optimisation step, all ranks together."""
    return train.batch_size * accumulation(train, world_size) * world_size


def world_sizes(train: TrainConfig) -> list[int]:
    """The world sizes a ``train.global_batch`` recipe runs on exactly: the divisors of its
    micro-batches ``n``, ascending ([] without the key)."""
    n = micro_batches(train)
    return [] if n is None else splits(n)


def splits(micro_batches: int) -> list[int]:
    """The rank counts that split ``micro_batches`` evenly, ascending (its divisors)."""
    return [p for p in range(1, micro_batches + 1) if micro_batches % p == 0]


def world_size_error(train: TrainConfig, world_size: int) -> str | None:
    """Why ``world_size`` ranks cannot run the step of ``train.global_batch`` (one line
    naming the world sizes that can), or None."""
    n = micro_batches(train)
    if n is None or n % world_size == 0:
        return None
    return (f"train.global_batch={train.global_batch}: {world_size} rank(s) cannot split its "
            f"{n} micro-batches of train.batch_size={train.batch_size} evenly; launch "
            f"{', '.join(map(str, world_sizes(train)))} rank(s), or change train.global_batch")
