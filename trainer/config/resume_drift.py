"""What may change when a run resumes: :func:`resume_drift` compares the config a checkpoint
was saved with to the current one, refuses a checkpoint trained as another model
(:data:`MODEL_KEYS`) and notes every other change."""

from __future__ import annotations

from typing import Any

from partial_fc.margins.registry import effective, margin_errors, read_keys
from trainer.config.schema import Config, ConfigError
from trainer.yaml_file import shown_value

# Keys whose change makes a checkpoint a different model (or an incompatible optimizer
# state): resuming across them is refused. Every other key may change, with a note.
# backbone.checkpointing may change (the same model and steps); backbone.depth may not.
MODEL_KEYS = ("backbone.name", "backbone.embedding_size", "backbone.dropout", "backbone.depth",
              "margin", "data.num_classes", "data.num_samples", "data.merge_digest",
              "optim.name", "engine.type")
NOT_COMPARED = ("name", "output", "checkpoint.resume", "margin.p_w")


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _margin_as_read(tree: dict) -> dict:
    """``tree`` with its margin section as the margin reads it (``partial_fc.margins``'
    ``effective``: the type's keys, defaults filled), so that the other types' keys a
    checkpoint's flat section held and a null meaning the default that was then in force
    compare equal; left as written when the section is not valid today."""
    margin = read_keys({k: v for k, v in (tree.get("margin") or {}).items() if k != "p_w"})
    if not margin or margin_errors(margin):
        return tree
    return {**tree, "margin": {**effective(margin), "p_w": tree["margin"].get("p_w")}}


def resume_drift(saved: dict | None, cfg: Config, where: str) -> list[str]:
    """Compare the config a checkpoint was saved with (``saved``, as :func:`dump_config`
    wrote it) to ``cfg``; return notes on the schedule keys that changed.

    Raises :class:`ConfigError` (one line, every model-defining difference, the way out)
    when the checkpoint at ``where`` was trained as another model. ``train.batch_size`` and
    the world size may change: the loader resumes at the same fraction of its epoch (see
    ``data_pipeline.loader``) and the LR schedule counts steps.
    """
    if saved is None:
        return ["none compared (the checkpoint holds no config)"]
    old = _flatten(_margin_as_read(saved))
    new = _flatten(_margin_as_read(cfg.model_dump(mode="json")))
    changed = [
        f"{key} {shown_value(old.get(key))} -> {shown_value(new.get(key))}"
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key) and not key.startswith(NOT_COMPARED)
    ]
    model = [c for c in changed if c.split(" ")[0].startswith(MODEL_KEYS)]
    if model:
        raise ConfigError(
            f"{where} was trained as another model: {', '.join(model)}; resume it with its "
            f"own settings, or start over with checkpoint.resume=none or another name"
        )
    return changed
