"""Cosine-margin target transforms (NormFace, SphereFace, CosFace, ArcFace, combined).

A margin maps the cosine of a sample's **target** class to the value ``psi`` that replaces
it in the logits; non-target logits stay ``s * cos`` (unless the margin declares a non-target
transform: ``partial_fc.nontarget``). The head computes ``logit_target = s * psi(cos_target)``
through the protocol of ``partial_fc.margin_step`` (:meth:`Margin.begin`); the margins that
read batch statistics are in ``partial_fc.adaptive_margins``, built here by
:func:`build_margin`. Every ``psi`` is computed in fp32 with its true
derivative by autograd; the deviations are the clamp of ``acos``'s input, stated where it
applies, and the opt-in straight-through gradient (``gradient="straight_through"``, see
:class:`Margin`). A margin owns its scale module (``self.scale``,
fixed or AdaCos, see ``partial_fc.scale``) so that ``head.state_dict()`` holds the scale
state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from partial_fc.margin_step import MarginBatch, MarginStep
from partial_fc.nontarget import NonTarget
from partial_fc.scale import AdaCosScale, FixedScale

__all__ = [
    "MARGIN_KEYS", "MARGIN_TYPES", "CombinedMargin", "Margin", "MarginGradient", "MarginType",
    "SphereFaceMargin", "build_margin", "margin_errors", "margin_warnings", "normface_scale_bound",
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
_LAMBDAS = ("lambda_base", "lambda_gamma", "lambda_power", "lambda_min")
# acos is clamped to [-1 + eps, 1 - eps]: 1 - 1e-7 rounds to the fp32 value 1 - 2**-23, where
# |d acos / d cos| is about 2.9e3 instead of infinity.
_ACOS_EPS = 1e-7


class Margin(nn.Module):
    """Base class: a target transform ``psi`` plus the scale module ``scale``.

    Margin warm-up (``warmup_steps > 0``): the head uses :meth:`begin`, which scales the
    margin's penalty ``cos - psi(cos)`` by ``t = min(1, step / warmup_steps)``, i.e.
    ``target = (1 - t) cos + t psi(cos)``: no margin (NormFace) at the first step, the full
    margin from step ``warmup_steps`` on. For CosFace this is the margin ``t m`` exactly; for
    the others it is the blend SphereFace's own annealing uses (arXiv:1704.08063), monotone in
    the angle as both ends are. It eases the start of training where a full angular margin
    stalls or diverges (ArcFace on ViTs: insightface issues #2144, #2043). The position in the
    ramp is the head's ``step`` buffer, so checkpoints (the head's state_dict) carry it.

    Gradient (``gradient``): ``"exact"`` differentiates ``target`` as written.
    ``"straight_through"`` keeps the forward value and takes ``d target / d cos = 1``: the
    margin term ``target(cos) - cos`` is a constant in the backward. That is what insightface's
    arcface_torch computes (``CombinedMarginLoss`` applies the angular margin in place under
    ``torch.no_grad``), so its published ArcFace numbers were trained with it; for CosFace
    and NormFace the two coincide (``docs/insightface.md`` has the measured difference).
    """

    gradient: MarginGradient = "exact"  # build_margin sets it from the config

    def __init__(self, scale: FixedScale | AdaCosScale, warmup_steps: int = 0) -> None:
        super().__init__()
        _raise(_warmup_errors(warmup_steps))
        self.scale = scale
        self.warmup_steps = int(warmup_steps)

    def psi(self, cos: Tensor, step: int) -> Tensor:
        """Target value for target cosines ``cos`` (any shape), fp32; ``step`` = the head's
        training steps so far (only SphereFace's lambda schedule reads it)."""
        raise NotImplementedError

    def warmup_factor(self, step: int) -> float:
        """The share ``t`` of the margin applied after ``step`` training steps."""
        return 1.0 if step >= self.warmup_steps else step / self.warmup_steps

    # The head's side of the protocol (partial_fc.margin_step). A margin that needs more than
    # psi(cos, step) overrides ``needs_norms`` and ``prepare``.
    needs_norms = False  # whether prepare reads MarginBatch.norms
    interclass_filter: float | None = None  # arcface_torch's tau (partial_fc.nontarget)

    def prepare(self, batch: MarginBatch) -> MarginStep:
        """This forward's target transform (before the warm-up), non-target transform, loss
        term and statistics; moves the margin's EMAs when ``batch.training``."""
        return MarginStep(psi=lambda c, _aux: self.psi(c, batch.step))

    def begin(self, batch: MarginBatch) -> MarginStep:
        """:meth:`prepare` under the warm-up (the target's penalty scaled by
        ``warmup_factor``), with the straight-through gradient when ``gradient`` asks for it
        (the margin term a constant in the backward: no gradient to ``aux`` either) and with
        the inter-class filter, if any."""
        out = self.prepare(batch)
        t, straight = self.warmup_factor(batch.step), self.gradient == "straight_through"

        def psi(c: Tensor, aux: Tensor | None, inner=out.psi) -> Tensor:
            value = inner(c, aux)
            if t != 1.0:
                value = torch.lerp(c.float(), value, t)
            return c.float() + (value - c.float()).detach() if straight else value
        nontarget = out.nontarget
        if self.interclass_filter is not None:
            nontarget = NonTarget(tau=self.interclass_filter) if nontarget is None else \
                dataclasses.replace(nontarget, tau=self.interclass_filter)
        return dataclasses.replace(out, psi=psi, nontarget=nontarget)

    def torch_path_reason(self) -> str | None:
        """Why this margin needs the class tiles' torch path (a non-target transform, which
        the Triton kernels do not apply), or None."""
        if self.interclass_filter is not None:
            return "margin.interclass_filter zeroes non-target cosines above it"
        return None


class CombinedMargin(Margin):
    """``psi = cos(m1*theta + m2) - m3`` (ArcFace, arXiv:1801.07698 Eq. 4), all three at once.

    Special cases: NormFace ``(1, 0, 0)``, CosFace ``(1, 0, m)`` (arXiv:1801.09414 Eq. 4),
    ArcFace ``(1, m, 0)`` (arXiv:1801.07698 Eq. 3). When ``m1 == 1 and m2 == 0`` no angle is
    taken (``psi = cos - m3`` exactly, derivative 1 everywhere).

    ``cos(m1*theta + m2)`` stops decreasing once ``m1*theta + m2 > pi``. Past that angle
    ``theta_th = (pi - m2) / m1`` one of two selectable behaviours applies:

    - default: ``psi = cos(theta) - m3 - (pi - theta_th) * sin(theta_th)``, the first-order
      penalty frozen at ``theta_th``; for ArcFace this is insightface's ``cos(theta) - m sin(m)``;
    - ``easy_margin=True``: the margin applies only where ``cos(theta) > 0``; elsewhere
      ``psi = cos(theta)`` (insightface's easy margin). Requires ``theta_th >= pi/2``.

    Deviation from the exact derivative: ``acos``'s input is clamped to ``[-1+1e-7, 1-1e-7]``
    (the true derivative of ``cos(theta + m)`` w.r.t. ``cos`` is infinite at ``cos = +-1``).
    Inside the band the gradient is exact; for ``|cos| > 1 - 1e-7`` (``theta`` within 5e-4
    rad of 0 or pi, below fp32's resolution of cos there) the value is that at the band edge
    and the gradient w.r.t. ``cos`` is 0, never NaN or inf.
    """

    def __init__(self, scale: FixedScale | AdaCosScale, m1: float = 1.0, m2: float = 0.0,
                 m3: float = 0.0, easy_margin: bool = False, warmup_steps: int = 0) -> None:
        super().__init__(scale, warmup_steps)
        _raise(_combined_errors(m1, m2, m3, easy_margin))
        self.m1, self.m2, self.m3, self.easy_margin = float(m1), float(m2), float(m3), easy_margin
        # theta_th: where m1*theta + m2 reaches pi; None when it never does on [0, pi].
        self.theta_th = (math.pi - m2) / m1 if m1 * math.pi + m2 > math.pi else None

    def psi(self, cos: Tensor, step: int) -> Tensor:
        c = cos.float()
        if self.m1 == 1.0 and self.m2 == 0.0:
            return c - self.m3
        theta = torch.acos(c.clamp(-1.0 + _ACOS_EPS, 1.0 - _ACOS_EPS))
        out = torch.cos(self.m1 * theta + self.m2) - self.m3
        if self.easy_margin:
            return torch.where(c > 0, out, c)
        if self.theta_th is None:
            return out
        penalty = (math.pi - self.theta_th) * math.sin(self.theta_th)
        return torch.where(c > math.cos(self.theta_th), out, c - self.m3 - penalty)

    def extra_repr(self) -> str:
        return (f"m1={self.m1}, m2={self.m2}, m3={self.m3}, easy_margin={self.easy_margin}, "
                f"warmup_steps={self.warmup_steps}")


def chebyshev_t(c: Tensor, m: int) -> Tensor:
    """``T_m(c) = cos(m * acos(c))`` by the recurrence ``T_{n+1} = 2c T_n - T_{n-1}``: a
    polynomial, so its autograd derivative is exact on all of [-1, 1] (no ``acos``)."""
    prev, cur = torch.ones_like(c), c
    if m == 0:
        return prev
    for _ in range(m - 1):
        prev, cur = cur, 2 * c * cur - prev
    return cur


class SphereFaceMargin(Margin):
    """SphereFace A-Softmax ``psi(theta) = (-1)^k cos(m theta) - 2k`` for
    ``theta in [k pi/m, (k+1) pi/m]`` (arXiv:1704.08063, the A-Softmax loss), monotone on
    [0, pi].

    ``cos(m theta)`` is the Chebyshev polynomial ``T_m(cos theta)`` (integer ``m``, as in the
    paper), so value and derivative are exact including ``cos = +-1``; ``k`` is piecewise
    constant (no gradient). Deviation: the paper multiplies by ``||x||``; here features are
    normalised and the head multiplies by ``s`` (as in the ArcFace combined-margin family).

    Annealing (the paper's optimisation trick, as in its released Caffe layer): with
    ``lambda_base > 0`` the target value is ``(lambda * cos + psi) / (1 + lambda)`` where
    ``lambda = max(lambda_min, lambda_base * (1 + lambda_gamma * step) ** -lambda_power)``
    and ``step`` counts the head's training steps. ``lambda_base = 0`` disables it.
    """

    def __init__(
        self,
        scale: FixedScale | AdaCosScale,
        m: int = 4,
        lambda_base: float = 1000.0,
        lambda_gamma: float = 0.12,
        lambda_power: float = 1.0,
        lambda_min: float = 5.0,
        warmup_steps: int = 0,
    ) -> None:
        super().__init__(scale, warmup_steps)
        lambdas = {"lambda_base": lambda_base, "lambda_gamma": lambda_gamma,
                   "lambda_power": lambda_power, "lambda_min": lambda_min}
        _raise(_sphereface_errors(m, lambdas))
        self.m = int(m)
        self.lambda_base, self.lambda_gamma = float(lambda_base), float(lambda_gamma)
        self.lambda_power, self.lambda_min = float(lambda_power), float(lambda_min)

    def lambda_at(self, step: int) -> float:
        """The annealing weight after ``step`` training forwards (0 when disabled)."""
        if self.lambda_base == 0:
            return 0.0
        decayed = self.lambda_base * (1.0 + self.lambda_gamma * step) ** (-self.lambda_power)
        return max(self.lambda_min, decayed)

    def psi(self, cos: Tensor, step: int) -> Tensor:
        c = cos.float().clamp(-1.0, 1.0)
        with torch.no_grad():
            k = torch.floor(self.m * torch.acos(c) / math.pi).clamp(0, self.m - 1)
        out = (1 - 2 * torch.remainder(k, 2)) * chebyshev_t(c, self.m) - 2 * k
        lam = self.lambda_at(step)
        return (lam * c + out) / (1 + lam) if lam > 0 else out

    def extra_repr(self) -> str:
        return (f"m={self.m}, lambda_base={self.lambda_base}, lambda_min={self.lambda_min}, "
                f"warmup_steps={self.warmup_steps}")


# Per-type defaults of ``m`` (the insightface / paper values); ``s`` defaults to 64.
_DEFAULT_M = {"sphereface": 4, "cosface": 0.35, "arcface": 0.5, "adaface": 0.4,
              "curricularface": 0.5, "elasticface_arc": 0.5, "elasticface_cos": 0.35}
_ELASTIC = ("elasticface_arc", "elasticface_cos")  # the types elastic_sort applies to


def _adaptive_keys(get: Any) -> dict[str, Any]:
    from partial_fc.adaptive_margins import ADAPTIVE_DEFAULTS  # subclasses of Margin

    return {k: get(k, v) for k, v in ADAPTIVE_DEFAULTS.items()}

# ----------------------------------------------------------------------------- the rules
# Every rule a margin's parameters obey lives here, once: the constructors, build_margin and
# trainer.config (which reports them before any process starts) all call these. Each error is
# (dotted config key, one line naming key, value and the valid range).


def _error(key: str, value: Any, rule: str) -> tuple[str, str]:
    return f"margin.{key}", f"margin.{key}={value!r}: {rule}"


def _raise(errors: list[tuple[str, str]]) -> None:
    if errors:
        raise ValueError("; ".join(msg for _, msg in errors))


def _nonneg(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value >= 0


def _angle(value: Any) -> bool:
    """A margin added to the angle: cos(theta + m) must still fall on theta in [0, pi]."""
    return _nonneg(value) and value < math.pi


def _warmup_errors(steps: Any) -> list[tuple[str, str]]:
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


def _combined_errors(m1: Any, m2: Any, m3: Any, easy_margin: bool) -> list[tuple[str, str]]:
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


def _sphereface_errors(m: Any, lambdas: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A-Softmax's ``cos(m*theta)`` is a Chebyshev polynomial only for integer ``m``."""
    out = []
    if not (isinstance(m, int | float) and float(m).is_integer() and m >= 1):
        out.append(_error("m", m, "SphereFace needs an integer m >= 1 (e.g. 4)"))
    out += [_error(k, v, "must be >= 0") for k, v in lambdas.items() if not _nonneg(v)]
    return out


def margin_errors(cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Every rule the margin config ``cfg`` (the keys of :func:`build_margin`) breaks, as
    ``(dotted key, message)``; empty when ``build_margin(cfg)`` will succeed (given ``s > 0``).
    """
    unknown = sorted(set(cfg) - MARGIN_KEYS)
    if unknown:
        return [("margin", f"margin: unknown key(s) {unknown}; valid keys: {sorted(MARGIN_KEYS)}")]
    get = {k: v for k, v in cfg.items() if v is not None}.get
    kind, adacos = get("type"), get("adacos")
    out = _warmup_errors(get("warmup_steps", 0)) + _subcenter_errors(get("subcenters", 1))
    if kind not in MARGIN_TYPES:
        out.append(_error("type", kind, f"not one of {'|'.join(MARGIN_TYPES)}"))
    if get("gradient", "exact") not in get_args(MarginGradient):
        out.append(_error("gradient", get("gradient"), "not one of exact|straight_through"))
    if adacos not in (None, *get_args(AdaCosMode)):
        out.append(_error("adacos", adacos, "not one of fixed|dynamic"))
    if kind == "adacos" and adacos is None:
        out.append(_error("adacos", None, "type=adacos needs adacos=fixed|dynamic"))
    m = get("m", _DEFAULT_M.get(kind, 0.0))
    if kind == "sphereface":
        out += _sphereface_errors(m, {k: get(k) for k in _LAMBDAS if get(k) is not None})
    elif kind == "cosface" and not _nonneg(m):
        out.append(_error("m", m, "CosFace needs m >= 0"))
    elif kind == "arcface":
        if not _angle(m):
            out.append(_error("m", m, "ArcFace needs 0 <= m < pi"))
        elif get("easy_margin", False):
            out += _easy_margin_errors(1.0, m, "m")
    elif kind == "combined":
        out += _combined_errors(get("m1", 1.0), get("m2", 0.0), get("m3", 0.0),
                                bool(get("easy_margin", False)))
    else:
        from partial_fc.adaptive_margins import adaptive_errors  # subclasses of Margin

        out += adaptive_errors(kind, m, _adaptive_keys(get))
    if get("elastic_sort", False) and kind not in _ELASTIC:
        out.append(_error("elastic_sort", True, f"only for type {'|'.join(_ELASTIC)}"))
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
    kind, s, m = get("type"), get("s", 64.0), get("m", _DEFAULT_M.get(get("type"), 0.0))
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


def build_margin(cfg: Mapping[str, Any]) -> Margin:
    """Build a margin from a config dict: :func:`_build_type`'s margin with the gradient
    ``cfg["gradient"]`` (``exact`` | ``straight_through``, default exact; see :class:`Margin`).
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
    keys (``partial_fc.adaptive_margins.ADAPTIVE_DEFAULTS``) and ``elastic_sort``. A key
    whose value is ``None`` counts as absent; keys a type does not use are ignored, so one
    schema can pass them all. When ``adacos`` is set, ``s`` is ignored (AdaCos sets it).
    Unknown keys or values raise ``ValueError`` naming them (:func:`margin_errors`).
    """
    _raise(margin_errors(cfg))
    get = {k: v for k, v in cfg.items() if v is not None}.get
    kind, adacos = get("type"), get("adacos")
    scale = AdaCosScale(adacos == "dynamic") if adacos else FixedScale(float(get("s", 64.0)))
    m = get("m", _DEFAULT_M.get(kind, 0.0))
    warmup = int(get("warmup_steps", 0))
    easy = bool(get("easy_margin", False))
    if kind == "sphereface":
        anneal = {k: float(get(k)) for k in _LAMBDAS if get(k) is not None}
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
        from partial_fc.adaptive_margins import build_adaptive  # subclasses of Margin

        margin = build_adaptive(kind, scale, float(m), warmup, _adaptive_keys(get),
                                bool(get("elastic_sort", False)))
    tau = float(get("interclass_filter", 0.0))
    margin.interclass_filter = tau if tau > 0 else None
    return margin

