"""What every config section shares: the strict base model, the bounded number types, and
ranges partial_fc declares (with its rule and its message).

Each section of the schema is a model in its own file of :mod:`trainer.config.sections`;
:mod:`trainer.config.schema` composes them into :class:`~trainer.config.schema.Config`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from partial_fc.margins.keys import Bounds

PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
UnitFloat = Annotated[float, Field(ge=0, lt=1)]


class Section(BaseModel):
    """A config section: unknown keys, wrong types and non-finite floats are refused."""

    # allow_inf_nan=False: a float key given as .inf/.nan (or 1e400) is refused, not trained on.
    model_config = ConfigDict(
        extra="forbid", strict=True, validate_default=True, allow_inf_nan=False
    )


def bounded(kind: Any, bounds: Bounds, need: str = "must be") -> Any:
    """``kind`` held to ``bounds``, a range partial_fc declares with its rule: the value gets
    that rule's message (``need``: its first words), ``--help`` shows the range."""
    def check(value: Any) -> Any:
        broken = None if value is None else bounds.rule(value, need)
        if broken:
            raise ValueError(broken)
        return value

    return Annotated[kind, bounds, AfterValidator(check)]
