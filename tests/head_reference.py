"""Single-process, full-softmax reference for the head tests, in plain PyTorch (float64).

Written from the papers' formulas independently of ``partial_fc``: the margins are spelled
out here again, the logits are materialised as ``[N, C]`` and the loss is ``F.cross_entropy``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

_EPS = 1e-7  # the library's documented acos clamp (only matters at |cos| > 1 - 1e-7)


def psi(cfg: dict, c: Tensor, step: int = 0) -> Tensor:
    """Target transform of a ``build_margin`` config, on target cosines ``c``."""
    kind = cfg["type"]
    if kind in ("normface", "adacos"):
        return c
    if kind == "cosface":
        return c - cfg["m"]
    if kind == "sphereface":
        m = cfg["m"]
        theta = torch.acos(c)
        k = torch.floor(m * theta / math.pi).detach()
        out = (-1) ** k * torch.cos(m * theta) - 2 * k
        base = cfg.get("lambda_base", 1000.0)
        if base == 0:
            return out
        decayed = base * (1 + cfg.get("lambda_gamma", 0.12) * step) ** -cfg.get("lambda_power", 1.0)
        lam = max(cfg.get("lambda_min", 5.0), decayed)
        return (lam * c + out) / (1 + lam)
    if kind == "arcface":
        m1, m2, m3 = 1.0, cfg["m"], 0.0
    else:
        m1, m2, m3 = cfg["m1"], cfg["m2"], cfg["m3"]
    theta = torch.acos(c.clamp(-1 + _EPS, 1 - _EPS))
    out = torch.cos(m1 * theta + m2) - m3
    if cfg.get("easy_margin"):
        return torch.where(c > 0, out, c)
    th = (math.pi - m2) / m1
    if th >= math.pi:
        return out
    return torch.where(c > math.cos(th), out, c - m3 - (math.pi - th) * math.sin(th))


def cosines(emb: Tensor, weight: Tensor) -> Tensor:
    return F.normalize(emb, dim=1) @ F.normalize(weight, dim=1).t()


def adacos_scale(cos: Tensor, labels: Tensor, s_prev: float, num_classes: int) -> float:
    """Dynamic AdaCos ``s_t`` from ``[N, S]`` cosines over (possibly sampled) classes, the
    non-target sum rescaled by ``(C - 1) / (S - 1)``."""
    with torch.no_grad():
        cos = cos.double()
        onehot = F.one_hot(labels, cos.shape[1]).bool()
        b = torch.exp(s_prev * cos).masked_fill(onehot, 0).sum(1) * (
            (num_classes - 1) / (cos.shape[1] - 1))
        theta_med = torch.median(torch.acos(cos[onehot]))
        return math.log(b.mean().item()) / math.cos(min(math.pi / 4, theta_med.item()))


def loss(emb: Tensor, weight: Tensor, labels: Tensor, cfg: dict, s: float,
         step: int = 0) -> Tensor:
    """``F.cross_entropy`` of ``s * cos`` with the target entries replaced by ``s * psi``."""
    cos = cosines(emb, weight)
    onehot = F.one_hot(labels, weight.shape[0]).bool()
    target = psi(cfg, cos[onehot], step)
    logits = s * cos.masked_scatter(onehot, target)
    return F.cross_entropy(logits, labels)
