"""``build_margin``: a margin from its config (``partial_fc.margin_rules`` holds the keys and
the rules; the classes live in ``partial_fc.margins`` and ``partial_fc.adaptive_margins``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from partial_fc.adaptive_margins import build_adaptive
from partial_fc.margin_rules import DEFAULT_M, LAMBDAS, adaptive_keys, margin_errors, raise_errors
from partial_fc.margins import CombinedMargin, Margin, SphereFaceMargin
from partial_fc.scale import AdaCosScale, FixedScale

__all__ = ["build_margin"]


def build_margin(cfg: Mapping[str, Any]) -> Margin:
    """Build a margin from a config dict: :func:`_build_type`'s margin with the gradient
    ``cfg["gradient"]`` (``exact`` | ``straight_through``, default exact; see
    ``partial_fc.margins.Margin``).
    """
    margin = _build_type(cfg)
    margin.gradient = cfg.get("gradient") or "exact"
    return margin


def _build_type(cfg: Mapping[str, Any]) -> Margin:
    """Build a margin from a config dict.

    Keys: ``type`` (one of ``MARGIN_TYPES``), ``s``, ``m`` (SphereFace/CosFace/ArcFace),
    ``m1, m2, m3`` (combined), ``adacos`` (``None | "fixed" | "dynamic"``; required for
    ``type=adacos``, combinable with any other type), ``easy_margin`` (ArcFace/combined),
    ``lambda_base, lambda_gamma, lambda_power, lambda_min`` (SphereFace annealing),
    ``warmup_steps`` (any type: the margin ramps in over that many forwards, see
    :class:`Margin`), ``interclass_filter`` (any type; 0 = off), the adaptive margins' own
    keys (``partial_fc.margin_rules.ADAPTIVE_DEFAULTS``) and ``elastic_sort``. A key
    whose value is ``None`` counts as absent; keys a type does not use are ignored, so one
    schema can pass them all. When ``adacos`` is set, ``s`` is ignored (AdaCos sets it).
    Unknown keys or values raise ``ValueError`` naming them
    (``partial_fc.margin_rules.margin_errors``).
    """
    raise_errors(margin_errors(cfg))
    get = {k: v for k, v in cfg.items() if v is not None}.get
    kind, adacos = get("type"), get("adacos")
    scale = AdaCosScale(adacos == "dynamic") if adacos else FixedScale(float(get("s", 64.0)))
    m = get("m", DEFAULT_M.get(kind, 0.0))
    warmup = int(get("warmup_steps", 0))
    easy = bool(get("easy_margin", False))
    if kind == "sphereface":
        anneal = {k: float(get(k)) for k in LAMBDAS if get(k) is not None}
        margin = SphereFaceMargin(scale, m=m, **anneal, warmup_steps=warmup)
    elif kind in ("normface", "adacos"):
        margin = CombinedMargin(scale, warmup_steps=warmup)
    elif kind == "cosface":
        margin = CombinedMargin(scale, m3=float(m), warmup_steps=warmup)
    elif kind == "arcface":
        margin = CombinedMargin(scale, m2=float(m), easy_margin=easy, warmup_steps=warmup)
    elif kind == "combined":
        margin = CombinedMargin(scale, float(get("m1", 1.0)), float(get("m2", 0.0)),
                                float(get("m3", 0.0)), easy, warmup_steps=warmup)
    else:
        margin = build_adaptive(kind, scale, float(m), warmup, adaptive_keys(get),
                                bool(get("elastic_sort", False)))
    tau = float(get("interclass_filter", 0.0))
    margin.interclass_filter = tau if tau > 0 else None
    return margin

