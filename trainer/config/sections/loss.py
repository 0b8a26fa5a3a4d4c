"""The loss sections: ``margin:`` (one model per ``margin.type``, generated from
``partial_fc.margins``' registry, so its keys, defaults and bounds live in the margins' own
files), ``loss:`` (ArcFace's auxiliary terms) and ``distill:`` (a teacher's embeddings)."""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, create_model

from partial_fc.margins.keys import Bounds
from partial_fc.margins.registry import (
    DEFAULT_TYPE,
    MARGIN_TYPES,
    SchemaKey,
    own_keys,
    schema_keys,
)
from trainer.config.sections.base import NonNegFloat, Section, bounded


def _margin_field(key: SchemaKey, kind: str) -> tuple[Any, Any]:
    """A ``margin:`` field of type ``kind`` from the registry's key, its bounds checked with
    the registry's message (``kind needs ...`` for the type's own keys)."""
    ann, b = key.annotation, key.bounds
    if b is not None and b != Bounds():
        need = f"{kind} needs" if key.name in own_keys(kind) else "must be"
        ann = bounded(ann, b, need)
    return ann, Field(key.default, description=key.description)


P_W = (Annotated[float, Field(gt=0, lt=1)], Field(
    0.9, description="target-class probability the NormFace/CosFace bound on margin.s is "
    "checked against (a warning only; not passed to the margin)"))


def _margin_model(kind: str) -> type[Section]:
    """The ``margin:`` section of ``margin.type=kind``, generated from its registry entry (the
    shared keys and the type's own: defaults, bounds, descriptions), plus ``p_w``."""
    return create_model(
        f"MarginConfig[{kind}]", __base__=Section, __doc__="Passed to "
        f"``partial_fc.build_margin`` minus ``p_w``; generated from ``REGISTRY[{kind!r}]``.",
        **{key.name: _margin_field(key, kind) for key in schema_keys(kind)}, p_w=P_W)


MARGIN_MODELS: dict[str, type[Section]] = {kind: _margin_model(kind) for kind in MARGIN_TYPES}


def _margin_tag(value: Any) -> Any:
    """The model a ``margin:`` value is validated by: its ``type`` (absent: the default type;
    not a mapping: the default type's model, which refuses it)."""
    if isinstance(value, BaseModel):
        return value.type
    tag = value.get("type", DEFAULT_TYPE) if isinstance(value, dict) else DEFAULT_TYPE
    return tag if isinstance(tag, str) else repr(tag)


# The margin section: one model per margin.type, chosen by the section's own type key, so that
# a key of another type is refused (trainer.config.files names the type that reads it). The
# rules that tie keys together (partial_fc.margins.registry.margin_errors) are reported by the
# config check.
MarginConfig = Annotated[
    typing.Union[tuple(Annotated[model, Tag(kind)]  # noqa: UP007 - built from a tuple
                       for kind, model in MARGIN_MODELS.items())],
    Discriminator(_margin_tag),
]


class LossConfig(Section):
    """ArcFace's auxiliary losses (arXiv:1801.07698 Eq. 5-7), added to the margin softmax with
    these weights (``partial_fc.aux_losses``)."""

    intra: NonNegFloat = Field(0.0, description="weight of Intra-Loss, the mean target angle / "
                               "pi; 0 = off")
    inter: NonNegFloat = Field(0.0, description="weight of Inter-Loss, minus the mean angle "
                               "between target centres and all other centres / pi; 0 = off")
    triplet: NonNegFloat = Field(0.0, description="weight of the angular Triplet-Loss "
                                 "(batch-hard over the global batch); 0 = off")
    triplet_margin: NonNegFloat = Field(0.35, description="Triplet-Loss margin (radians)")


class DistillConfig(Section):
    """Embedding distillation from a frozen teacher (partial_fc.distill), added to the
    margin loss: ``loss = margin loss + weight * distillation loss``."""

    embeddings: str | None = Field(
        None, description="offline teacher: the folder python -m launch.embed wrote for "
        "data.dir (read by sample key; no teacher forward during training)"
    )
    teacher: str | None = Field(
        None, description="online teacher: a run folder, checkpoint or .onnx file, run on "
        "every batch (a second forward pass per step; small sets)"
    )
    loss: Literal["cosine", "l2", "similarity"] = Field(
        "cosine", description="cosine: 1 - cos(student, teacher); l2: squared distance of the "
        "raw embeddings; similarity: the global batch's cosine-similarity matrices compared "
        "(relational, any teacher width)"
    )
    weight: NonNegFloat = Field(1.0, description="the distillation loss's factor")
    head_init: bool = Field(
        False, description="distill.embeddings only: start each class centre (head row) in "
        "the direction of the mean of its samples' teacher embeddings, a shared embedding "
        "space (fresh runs; needs the teacher's width)"
    )

    @property
    def enabled(self) -> bool:
        return self.embeddings is not None or self.teacher is not None
