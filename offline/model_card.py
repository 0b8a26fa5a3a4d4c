"""The model card (``README.md``) of an exported backbone, in the Hugging Face Hub's format.

A Hub model card is Markdown under a YAML front matter block (``---`` ... ``---``) whose keys
the Hub reads: ``license`` (one of its licence identifiers, else ``other`` with
``license_name``), ``library_name``, ``tags``, ``pipeline_tag`` and ``model-index`` (the
evaluation results, one entry per dataset). ``huggingface_hub.upload_folder`` publishes the
folder as it is; nothing here uploads.

Everything in the card comes from the run: its resolved ``config.yaml`` (data, backbone,
margin, schedule), the checkpoint's step and the newest evaluation row of ``metrics.jsonl``
(``val/<set>/<metric>``); the licence is the one the user states, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainer.telemetry.run_files import METRICS, read_jsonl
from trainer.yaml_file import read_mapping

# The Hub's identifiers for the licences face models are published under
# (https://huggingface.co/docs/hub/repositories-licenses); any other goes as `other`.
HUB_LICENSES = frozenset({
    "apache-2.0", "mit", "bsd-3-clause", "bsd-2-clause", "cc-by-4.0", "cc-by-sa-4.0",
    "cc-by-nc-4.0", "cc-by-nc-sa-4.0", "cc-by-nc-nd-4.0", "cc0-1.0", "gpl-3.0", "agpl-3.0",
    "lgpl-3.0", "openrail", "unlicense", "other",
})


@dataclass(frozen=True)
class CardFacts:
    """What the card states, gathered from the run folder by the exporter."""

    name: str  # the run's name
    config: dict[str, Any]  # the run's resolved config.yaml
    step: int | None  # the exported checkpoint's optimizer step
    evaluation: dict[str, dict[str, float]]  # set -> metric -> value (newest evaluation)
    license: str  # as the user stated it


def card_facts(config_path: Path, weights: Path, license: str) -> CardFacts:
    """The facts of the checkpoint ``weights`` (``RUN/checkpoints/<tag>/backbone.pt``) of the
    run whose resolved config is ``config_path``: the step is the tag's (``step-N``), else
    the last training row's in ``metrics.jsonl``."""
    config = read_mapping(config_path)
    rows = read_jsonl(config_path.parent / METRICS)
    tag = weights.parent.name
    if re.fullmatch(r"step-\d+", tag):
        step: int | None = int(tag.removeprefix("step-"))
    else:
        step = max((r["step"] for r in rows if "loss" in r and "step" in r), default=None)
    return CardFacts(name=str(config.get("name") or config_path.parent.name), config=config,
                     step=step, evaluation=latest_evaluation(rows), license=license)


def latest_evaluation(rows: list[dict]) -> dict[str, dict[str, float]]:
    """``{set: {metric: value}}`` from the newest ``metrics.jsonl`` row holding ``val/`` keys;
    ``{}`` when the run never evaluated."""
    for row in reversed(rows):
        found: dict[str, dict[str, float]] = {}
        for key, value in row.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "val" and isinstance(value, int | float):
                found.setdefault(parts[1], {})[parts[2]] = value
        if found:
            return found
    return {}


def _license_keys(license: str) -> dict[str, str]:
    slug = license.strip().lower()
    if slug in HUB_LICENSES:
        return {"license": slug}
    return {"license": "other", "license_name": re.sub(r"[^a-z0-9.-]+", "-", slug).strip("-")}


def _model_index(facts: CardFacts) -> list[dict]:
    results = [{
        "task": {"type": "face-verification", "name": "Face verification"},
        "dataset": {"type": name, "name": name},
        "metrics": [{"type": metric, "value": value} for metric, value in sorted(metrics.items())
                    if metric == "accuracy" or metric.startswith("tar@far")],
    } for name, metrics in sorted(facts.evaluation.items())]
    return [{"name": facts.name, "results": results}] if results else []


def _front_matter(facts: CardFacts) -> str:
    backbone = facts.config.get("backbone", {})
    margin = facts.config.get("margin", {})
    keys: dict[str, Any] = {
        **_license_keys(facts.license),
        "library_name": "partial-fc",
        "pipeline_tag": "image-feature-extraction",
        "tags": ["face-recognition", "partial-fc", str(backbone.get("name")),
                 str(margin.get("type", "arcface"))],
    }
    index = _model_index(facts)
    if index:
        keys["model-index"] = index
    return "---\n" + yaml.safe_dump(keys, sort_keys=False) + "---\n"


def _evaluation_table(evaluation: dict[str, dict[str, float]]) -> list[str]:
    if not evaluation:
        return ["The run was not evaluated during training; `python -m launch.evaluate` "
                "measures it on a `.bin` set."]
    columns = sorted({m for r in evaluation.values() for m in r
                      if m == "accuracy" or m.startswith("tar@far")})
    lines = ["| set | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, r in sorted(evaluation.items()):
        cells = [f"{100 * r[c]:.2f}" if c in r else "-" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return ["Percent, with flip TTA (embedding of the face plus its mirror):", "", *lines]


def model_card(facts: CardFacts) -> str:
    """The card's text: front matter, then what the model is, how to use it, how it was
    trained and how it scored."""
    cfg = facts.config
    backbone, margin = cfg.get("backbone", {}), cfg.get("margin", {})
    data, train = cfg.get("data", {}), cfg.get("train", {})
    margin_values = ", ".join(f"{k}={v}" for k, v in margin.items()
                              if k != "type" and isinstance(v, int | float) and v is not None)
    trained = [
        f"- data: `{', '.join(map(str, data.get('dirs') or [data.get('dir')]))}` "
        f"({data.get('num_classes')} identities, {data.get('num_samples')} images)",
        f"- margin: {margin.get('type', 'arcface')} ({margin_values})",
        f"- steps: {facts.step if facts.step is not None else 'unknown'} "
        f"(batch {train.get('batch_size')} per rank, {train.get('epochs')} epochs planned)",
    ]
    return "\n".join([
        _front_matter(facts).rstrip("\n"),
        "",
        f"# {facts.name}: {backbone.get('name')} face embeddings "
        f"({backbone.get('embedding_size')}-d)",
        "",
        "A face-recognition backbone trained with [partial-fc](https://arxiv.org/abs/2203.15565)"
        f". Licence: {facts.license}.",
        "",
        "## Use",
        "",
        "```python",
        "from trainer.pretrained import load_pretrained",
        "model = load_pretrained(\"FOLDER\")  # eval mode, CPU",
        "```",
        "",
        "Input: aligned 112x112 RGB faces, `(pixel - 127.5) / 127.5` (`config.json`). "
        "The embedding is un-normalised; compare L2-normalised embeddings by cosine.",
        "",
        "## Training",
        "",
        *trained,
        "",
        "## Evaluation",
        "",
        *_evaluation_table(facts.evaluation),
        "",
    ])
