"""The margin config's keys, types and rules (``build_margin``'s keys, ``trainer.config``'s
``margin:`` section).

Every rule a margin's parameters obey lives here, once: the margins' constructors,
``build_margin`` and ``trainer.config`` (which reports them before any process starts) all call
these. Each error is (dotted config key, one line naming key, value and the valid range).
Pure Python: no torch, no margin classes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, get_args

__all__ = [
    "ADAPTIVE_DEFAULTS", "DEFAULT_M", "ELASTIC_TYPES", "LAMBDAS", "MARGIN_KEYS", "MARGIN_TYPES",
    "AdaCosMode", "MarginGradient", "MarginType", "adaptive_keys", "combined_errors",
    "margin_errors", "margin_warnings", "normface_scale_bound", "raise_errors",
    "sphereface_errors", "warmup_errors",
]

MarginType = Literal["normface", "sphereface", "cosface", "arcface", "combined", "adacos",
                     "adaface", "curricularface", "magface", "elasticface_arc", "elasticface_cos"]
MARGIN_TYPES: tuple[str, ...] = get_args(MarginType)
AdaCosMode = Literal["fixed", "dynamic"]
MarginGradient = Literal["exact", "straight_through"]
# The keys build_margin reads. trainer.config.MarginConfig declares each one for the user (with
# its default and description, plus the validation-only p_w); a test holds the two equal.
MARGIN_KEYS = frozenset(
    {"type", "s", "m", "m1", "m2", "m3", "adacos", "easy_margin", "warmup_steps", "gradient"}
    | {"lambda_base", "lambda_gamma", "lambda_power", "lambda_min"}
    | {"h", "ema", "l_a", "u_a", "l_m", "u_m", "lambda_g", "sigma", "elastic_sort",
       "interclass_filter"}
    | {"subcenters"}  # read by PartialFC (the weight's shape), not by the margin
)
LAMBDAS = ("lambda_base", "lambda_gamma", "lambda_power", "lambda_min")
# Per-type defaults of ``m`` (the insightface / paper values); ``s`` defaults to 64.
DEFAULT_M = {"sphereface": 4, "cosface": 0.35, "arcface": 0.5, "adaface": 0.4,
             "curricularface": 0.5, "elasticface_arc": 0.5, "elasticface_cos": 0.35}
ELASTIC_TYPES = ("elasticface_arc", "elasticface_cos")  # the types elastic_sort applies to
# The defaults of the adaptive margins' own keys: AdaFace's h and EMA (arXiv:2204.00964),
# CurricularFace's EMA (arXiv:2004.00288), MagFace's bounds and lambda_g (arXiv:2103.06627),
# ElasticFace's sigma (0.05, the released configs of arXiv:2109.09416 for both variants).
ADAPTIVE_DEFAULTS = {"h": 0.333, "ema": 0.01, "l_a": 10.0, "u_a": 110.0, "l_m": 0.45,
                     "u_m": 0.8, "lambda_g": 35.0, "sigma": 0.05}


def adaptive_keys(get: Any) -> dict[str, Any]:
    """The adaptive margins' own keys: ``get(key, default)`` for each of ADAPTIVE_DEFAULTS."""
    return {k: get(k, v) for k, v in ADAPTIVE_DEFAULTS.items()}


def _error(key: str, value: Any, rule: str) -> tuple[str, str]:
    return f"margin.{key}", f"margin.{key}={value!r}: {rule}"


def raise_errors(errors: list[tuple[str, str]]) -> None:
    """Raise one ``ValueError`` joining every message of ``errors``, if any."""
    if errors:
        raise ValueError("; ".join(msg for _, msg in errors))


def _nonneg(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value >= 0


def _angle(value: Any) -> bool:
    """A margin added to the angle: cos(theta + m) must still fall on theta in [0, pi]."""
    return _nonneg(value) and value < math.pi


def warmup_errors(steps: Any) -> list[tuple[str, str]]:
    if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0:
        return []
    return [_error("warmup_steps", steps, "must be an int >= 0 (0 = the full margin at once)")]


def _subcenter_errors(k: Any) -> list[tuple[str, str]]:
    if isinstance(k, int) and not isinstance(k, bool) and k >= 1:
        return []
    return [_error("subcenters", k, "must be an int >= 1 (1 = one centre per class; the "
                   "sub-center ArcFace paper uses 3)")]


def _easy_margin_errors(m1: float, m2: float, key: str) -> list[tuple[str, str]]:
    """``easy_margin`` keeps ``cos(m1*theta + m2)`` for ``cos(theta) > 0`` only, so that
    branch must be monotone up to ``theta = pi/2``: ``m1*pi/2 + m2 <= pi``."""
    if m1 * math.pi / 2 + m2 <= math.pi:
        return []
    return [_error(key, m2, f"easy_margin needs m1*pi/2 + m2 <= pi (m1={m1})")]


def combined_errors(m1: Any, m2: Any, m3: Any, easy_margin: bool) -> list[tuple[str, str]]:
    """``cos(m1*theta + m2) - m3`` (arXiv:1801.07698 Eq. 4)."""
    out = []
    if not (_nonneg(m1) and m1 > 0):
        out.append(_error("m1", m1, "must be a finite number > 0"))
    if not _angle(m2):
        out.append(_error("m2", m2, "must be in [0, pi)"))
    if not _nonneg(m3):
        out.append(_error("m3", m3, "must be >= 0"))
    if easy_margin and not out:
        out += _easy_margin_errors(m1, m2, "m2")
    return out


def sphereface_errors(m: Any, lambdas: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A-Softmax's ``cos(m*theta)`` is a Chebyshev polynomial only for integer ``m``."""
    out = []
    if not (isinstance(m, int | float) and float(m).is_integer() and m >= 1):
        out.append(_error("m", m, "SphereFace needs an integer m >= 1 (e.g. 4)"))
    out += [_error(k, v, "must be >= 0") for k, v in lambdas.items() if not _nonneg(v)]
    return out


def _adaptive_errors(kind: Any, m: Any, keys: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The rules of AdaFace, CurricularFace, MagFace and ElasticFace's own keys."""
    out = []
    if kind in ("adaface", "curricularface", "elasticface_arc") and not _angle(m):
        out.append(_error("m", m, f"{kind} needs 0 <= m < pi (radians)"))
    if kind == "elasticface_cos" and not _nonneg(m):
        out.append(_error("m", m, "elasticface_cos needs m >= 0"))
    if kind == "adaface" and not (_nonneg(keys["h"]) and keys["h"] > 0):
        out.append(_error("h", keys["h"], "must be > 0"))
    ema = keys["ema"]
    if kind in ("adaface", "curricularface") and not (_nonneg(ema) and 0 < ema <= 1):
        out.append(_error("ema", ema, "must be in (0, 1]"))
    if kind in ELASTIC_TYPES and not _nonneg(keys["sigma"]):
        out.append(_error("sigma", keys["sigma"], "must be >= 0"))
    if kind == "magface":
        l_a, u_a, l_m, u_m = (keys[k] for k in ("l_a", "u_a", "l_m", "u_m"))
        if not (_nonneg(l_a) and _nonneg(u_a) and 0 < l_a < u_a):
            out.append(_error("u_a", u_a, f"MagFace needs 0 < l_a < u_a (l_a={l_a})"))
        if not (_angle(l_m) and _angle(u_m) and l_m <= u_m):
            out.append(_error("u_m", u_m, f"MagFace needs 0 <= l_m <= u_m < pi (l_m={l_m})"))
        if not _nonneg(keys["lambda_g"]):
            out.append(_error("lambda_g", keys["lambda_g"], "must be >= 0"))
    return out


def margin_errors(cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Every rule the margin config ``cfg`` (the keys of ``build_margin``) breaks, as
    ``(dotted key, message)``; empty when ``build_margin(cfg)`` will succeed (given ``s > 0``).
    """
    unknown = sorted(set(cfg) - MARGIN_KEYS)
    if unknown:
        return [("margin", f"margin: unknown key(s) {unknown}; valid keys: {sorted(MARGIN_KEYS)}")]
    get = {k: v for k, v in cfg.items() if v is not None}.get
    kind, adacos = get("type"), get("adacos")
    out = warmup_errors(get("warmup_steps", 0)) + _subcenter_errors(get("subcenters", 1))
    if kind not in MARGIN_TYPES:
        out.append(_error("type", kind, f"not one of {'|'.join(MARGIN_TYPES)}"))
    if get("gradient", "exact") not in get_args(MarginGradient):
        out.append(_error("gradient", get("gradient"), "not one of exact|straight_through"))
    if adacos not in (None, *get_args(AdaCosMode)):
        out.append(_error("adacos", adacos, "not one of fixed|dynamic"))
    if kind == "adacos" and adacos is None:
        out.append(_error("adacos", None, "type=adacos needs adacos=fixed|dynamic"))
    m = get("m", DEFAULT_M.get(kind, 0.0))
    if kind == "sphereface":
        out += sphereface_errors(m, {k: get(k) for k in LAMBDAS if get(k) is not None})
    elif kind == "cosface" and not _nonneg(m):
        out.append(_error("m", m, "CosFace needs m >= 0"))
    elif kind == "arcface":
        if not _angle(m):
            out.append(_error("m", m, "ArcFace needs 0 <= m < pi"))
        elif get("easy_margin", False):
            out += _easy_margin_errors(1.0, m, "m")
    elif kind == "combined":
        out += combined_errors(get("m1", 1.0), get("m2", 0.0), get("m3", 0.0),
                                bool(get("easy_margin", False)))
    else:
        out += _adaptive_errors(kind, m, adaptive_keys(get))
    if get("elastic_sort", False) and kind not in ELASTIC_TYPES:
        out.append(_error("elastic_sort", True, f"only for type {'|'.join(ELASTIC_TYPES)}"))
    tau = get("interclass_filter", 0.0)
    if not (_nonneg(tau) and tau < 1):
        out.append(_error("interclass_filter", tau, "must be in [0, 1) (0 = off)"))
    return out


def normface_scale_bound(num_classes: int, p_w: float) -> float:
    """Smallest fixed scale s for which the softmax can reach target probability ``p_w``.

    NormFace (arXiv:1704.06369, Prop. 2) / CosFace (arXiv:1801.09414, Sec. 3.4, Eq. 9):
    ``s >= (C - 1) / C * ln((C - 1) * P_W / (1 - P_W))``.
    """
    c = num_classes
    return (c - 1) / c * math.log((c - 1) * p_w / (1 - p_w))


def margin_warnings(cfg: Mapping[str, Any], num_classes: int, p_w: float) -> list[str]:
    """Settings that train but contradict the theory for ``num_classes`` classes, one line
    each: a fixed scale below the NormFace/CosFace bound at target probability ``p_w``, a
    CosFace margin outside ``[0, C/(C-1)]``. Empty for ``C < 2``."""
    c = num_classes
    if c < 2:
        return []
    get = {k: v for k, v in cfg.items() if v is not None}.get
    kind, s, m = get("type"), get("s", 64.0), get("m", DEFAULT_M.get(get("type"), 0.0))
    out = []
    if kind not in ("sphereface", "adacos") and get("adacos") is None:  # a fixed cosine scale
        bound = normface_scale_bound(c, p_w)
        if s < bound:
            out.append(
                f"margin.s={s} is below the NormFace/CosFace bound {bound:.2f} for C={c} "
                f"classes at P_W={p_w}: the loss cannot reach P_W (arXiv:1801.09414 Eq. 9)"
            )
    if kind == "cosface" and not 0 <= m <= c / (c - 1):
        out.append(
            f"margin.m={m} is outside the CosFace range [0, C/(C-1)] = [0, {c / (c - 1):.4f}] "
            f"for C={c} (arXiv:1801.09414 Sec. 3.4)"
        )
    return out
