"""What a run says about its settings at start: the margin it trains with, and one line
wherever one setting overrules another, naming the key that decides: a run
that ends before ``train.max_steps`` because ``train.epochs`` ends first, and a resumed run
whose learning-rate schedule jumps because its length or shape changed (a finished run
extended with ``train.epochs=8``: the poly decay restarts from a higher point).

Pure functions of the configs and the loader's steps per epoch; the loop logs what they
return."""

from __future__ import annotations

from partial_fc.margins.registry import own_keys
from trainer.config import Config

# The keys that shape the LR schedule (besides the steps per epoch).
SCHEDULE_KEYS = ("train.epochs", "train.max_steps", "schedule.", "optim.lr")


def run_length(cfg: Config, steps_per_epoch: int) -> tuple[int, int]:
    """``(total steps, warm-up steps)``: ``train.epochs`` epochs, cut at ``train.max_steps``."""
    total = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps is not None:
        total = min(total, cfg.train.max_steps)
    return total, round(cfg.schedule.warmup_epochs * steps_per_epoch)


def epochs_end_first(cfg: Config, steps_per_epoch: int) -> str | None:
    """The line for a ``train.max_steps`` that ``train.epochs`` never lets the run reach."""
    max_steps, epochs = cfg.train.max_steps, cfg.train.epochs
    if max_steps is None or max_steps <= epochs * steps_per_epoch:
        return None
    return (f"note: train.max_steps={max_steps} is not reached: train.epochs={epochs} ends the "
            f"run first, at step {epochs * steps_per_epoch} ({steps_per_epoch} steps/epoch); "
            f"raise train.epochs (e.g. train.epochs="
            f"{-(-max_steps // steps_per_epoch)}) to train {max_steps} steps")


def schedule_jump(saved: dict | None, cfg: Config, step: int, steps_per_epoch: int,
                  changed: list[str]) -> str | None:
    """The line for a resume at ``step`` whose learning rate differs from the one the saved
    run's own schedule (``saved``: the checkpoint's config) gives there; ``changed`` is
    :func:`trainer.config.resume_drift`'s list, from which the deciding keys are named."""
    from trainer.engine.optimizers import lr_factor  # the engine's own schedule (torch at import)

    if saved is None:
        return None
    try:
        old_cfg = Config.model_validate(saved)
    except ValueError:  # a config of an older schema: nothing to compare with
        return None
    old = old_cfg.optim.lr * lr_factor(old_cfg.schedule,
                                       *reversed(run_length(old_cfg, steps_per_epoch)))(step)
    new = cfg.optim.lr * lr_factor(cfg.schedule, *reversed(run_length(cfg, steps_per_epoch)))(
        step)
    if abs(new - old) <= 1e-6 * max(abs(old), abs(new)):
        return None
    keys = [c for c in changed if c.startswith(SCHEDULE_KEYS)] or ["the steps per epoch"]
    return (f"note: the learning rate jumps at step {step} from {old:.4g} (the saved run's "
            f"schedule) to {new:.4g}, because of {', '.join(keys)}: the schedule spans the "
            "new length from step 0")


def margin_words(cfg: Config) -> str:
    """The margin a run trains with, for its start line: ``margin cosface s=30 m=0.35`` (the
    type's own numeric keys; ``s=AdaCos fixed`` where AdaCos sets the scale)."""
    k = cfg.margin_kwargs()
    scale = f"AdaCos {k['adacos']}" if k.get("adacos") else f"{k['s']:g}"
    own = [f"{name}={k[name]:g}" for name in own_keys(k["type"])
           if isinstance(k[name], int | float) and not isinstance(k[name], bool)]
    return " ".join([f"margin {k['type']} s={scale}", *own])
