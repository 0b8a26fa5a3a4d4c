"""The base of every margin: a target transform ``psi`` plus the scale module, the warm-up,
the straight-through gradient and the inter-class filter that any type may take, and the one
clamped ``acos`` every margin (and ``partial_fc.aux_losses``) uses.

A margin maps the cosine of a sample's **target** class to the value ``psi`` that replaces
it in the logits; non-target logits stay ``s * cos`` (unless the margin declares a non-target
transform: ``partial_fc.nontarget``). The head computes ``logit_target = s * psi(cos_target)``
through the protocol of ``partial_fc.margins.step`` (:meth:`Margin.begin`). Every ``psi`` is
computed in fp32 with its true derivative by autograd; the deviations are the clamp of
``acos``'s input, stated where it applies, and the opt-in straight-through gradient
(``gradient="straight_through"``, see :class:`Margin`). A margin owns its scale module
(``self.scale``, fixed or AdaCos, see ``partial_fc.scale``) so that ``head.state_dict()``
holds the scale state.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from partial_fc.margins.keys import MarginGradient, SharedConfig, key_errors, raise_errors
from partial_fc.margins.step import MarginBatch, MarginStep
from partial_fc.nontarget import NonTarget
from partial_fc.scale import AdaCosScale, FixedScale

__all__ = ["ACOS_EPS", "Margin", "Scale", "acos", "spread"]

Scale = FixedScale | AdaCosScale

# acos is clamped to [-1 + eps, 1 - eps]: 1 - 1e-7 rounds to the fp32 value 1 - 2**-23, where
# |d acos / d cos| is about 2.9e3 instead of infinity.
ACOS_EPS = 1e-7


def acos(c: Tensor) -> Tensor:
    """``acos`` of ``c``, its input clamped to ``[-1 + ACOS_EPS, 1 - ACOS_EPS]``: past the band
    the value is the band edge's and the gradient 0, never NaN or inf."""
    return torch.acos(c.clamp(-1.0 + ACOS_EPS, 1.0 - ACOS_EPS))


def spread(x: Tensor) -> dict[str, Tensor]:
    """Mean and unbiased std of a 1-D tensor (std 0 for one element)."""
    std = x.std() if x.numel() > 1 else torch.zeros((), device=x.device)
    return {"mean": x.mean(), "std": std}


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

    def __init__(self, scale: Scale, warmup_steps: int = 0) -> None:
        super().__init__()
        raise_errors(key_errors(SharedConfig, {"warmup_steps": warmup_steps}))
        self.scale = scale
        self.warmup_steps = int(warmup_steps)

    def psi(self, cos: Tensor, step: int) -> Tensor:
        """Target value for target cosines ``cos`` (any shape), fp32; ``step`` = the head's
        training steps so far (only SphereFace's lambda schedule reads it)."""
        raise NotImplementedError

    def warmup_factor(self, step: int) -> float:
        """The share ``t`` of the margin applied after ``step`` training steps."""
        return 1.0 if step >= self.warmup_steps else step / self.warmup_steps

    # The head's side of the protocol (partial_fc.margins.step). A margin that needs more than
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
