"""Single-process float64 references of the adaptive margins and ArcFace's auxiliary losses,
written from the papers' equations independently of ``partial_fc`` (whose code they check):
full ``[N, C]`` logits, ``F.cross_entropy``, autograd for every gradient.

``reference(cfg, aux, emb, weight, labels, state, step, draw)`` takes the *un-normalised*
embeddings (AdaFace and MagFace read their norms), the rows the softmax runs over and the
labels as columns of them; ``state`` holds the EMAs before the forward and the returned one
after it. ElasticFace's draws are the library's documented recipe
(``partial_fc.margins.elasticface.elastic_generator``), spelled out here again.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from partial_fc.init import derive_seed

ACOS_EPS = 1e-7  # the library's documented acos clamp
ADAFACE_EPS = 1e-3  # AdaFace's code: cosine clamp, theta clip, std guard
INITIAL_STATE = {"mu": 20.0, "sd": 100.0, "t": 0.0}  # AdaFace's code; CurricularFace's t_0


def _acos(c: Tensor) -> Tensor:
    return torch.acos(c.clamp(-1 + ACOS_EPS, 1 - ACOS_EPS))


def arcface(c: Tensor, m: float) -> Tensor:
    """``cos(theta + m)`` with insightface's fallback past ``pi - m`` (ArcFace Eq. 3)."""
    th = math.pi - m
    return torch.where(c > math.cos(th), torch.cos(_acos(c) + m),
                       c - (math.pi - th) * math.sin(th))


def adaface(c: Tensor, norms: Tensor, cfg: dict, state: dict) -> tuple[Tensor, dict]:
    """AdaFace arXiv:2204.00964 Eq. 11-13: EMAs (Eq. 12) of the batch's norm mean and std,
    then ``z_hat`` and ``cos(theta - m z_hat) - (m + m z_hat)``; norms detached."""
    m, h, alpha = cfg["m"], cfg["h"], cfg["ema"]
    a = norms.detach().clamp(0.001, 100)
    mu = alpha * a.mean() + (1 - alpha) * state["mu"]
    sd = alpha * a.std() + (1 - alpha) * state["sd"]
    z = (h * (a - mu) / (sd + ADAFACE_EPS)).clamp(-1, 1)
    theta = torch.acos(c.clamp(-1 + ADAFACE_EPS, 1 - ADAFACE_EPS))
    out = torch.cos((theta - m * z).clamp(ADAFACE_EPS, math.pi - ADAFACE_EPS)) - (m + m * z)
    return out, {**state, "mu": mu.item(), "sd": sd.item()}


def magface(c: Tensor, norms: Tensor, cfg: dict) -> tuple[Tensor, Tensor]:
    """MagFace arXiv:2103.06627 Eq. 3-5: ``m(a)`` linear in the clamped norm, ArcFace's
    transform with it (the authors' easy margin: none where ``cos <= 0``; without it the
    fallback past ``pi - m``), and ``lambda_g * mean g(a)``, ``g(a) = a / u_a^2 + 1 / a``."""
    a = norms.clamp(cfg["l_a"], cfg["u_a"])
    m = (cfg["u_m"] - cfg["l_m"]) / (cfg["u_a"] - cfg["l_a"]) * (a - cfg["l_a"]) + cfg["l_m"]
    if cfg.get("easy_margin", True):
        out = torch.where(c > 0, torch.cos(_acos(c) + m), c)
    else:
        out = torch.where(c > torch.cos(math.pi - m), torch.cos(_acos(c) + m),
                          c - torch.sin(math.pi - m) * m)
    return out, cfg["lambda_g"] * (a / cfg["u_a"] ** 2 + 1 / a).mean()


def elastic_margins(c: Tensor, cfg: dict, step: int, draw: int) -> Tensor:
    """ElasticFace arXiv:2109.09416 Eq. 4-5: ``m_i ~ N(m, sigma^2)``; ElasticFace+ sorts the
    draws and gives sample ``i`` ``sorted[order[i]]`` (the authors' code; ``order`` the
    descending argsort of the target cosines) or, ``elastic_sort="paper"``, the draw of its
    rank (largest cosine, least margin)."""
    gen = torch.Generator().manual_seed(derive_seed(0xE1A5, step, draw))
    draws = (torch.randn(len(c), generator=gen, dtype=torch.float64) * cfg["sigma"]
             + cfg["m"]).float().double()  # the library draws in fp64 and keeps fp32
    if not cfg["type"].endswith("_plus"):
        return draws
    order = torch.sort(c.detach(), descending=True, stable=True).indices
    if cfg.get("elastic_sort", "authors") == "authors":
        return draws.sort().values[order]
    out = torch.empty_like(draws)
    out[order] = draws.sort().values
    return out


def triplet(e: Tensor, labels: Tensor, margin: float) -> Tensor:
    """ArcFace Eq. 7 in angle, each anchor's hardest positive and negative of the batch."""
    theta = _acos(e @ e.t())
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(labels), dtype=torch.bool)
    losses = []
    for i in range(len(labels)):
        pos, neg = same[i] & ~eye[i], ~same[i]
        if pos.any() and neg.any():
            losses.append((theta[i][pos].max() + margin - theta[i][neg].min()).clamp_min(0))
    return torch.stack(losses).mean() if losses else torch.zeros((), dtype=e.dtype)


def reference(cfg: dict, aux: dict, emb: Tensor, weight: Tensor, labels: Tensor, state: dict,
              step: int = 0, draw: int = 0) -> tuple[Tensor, dict]:
    """The loss of one forward and the EMAs after it (see the module docstring)."""
    norms = emb.norm(dim=1)
    e = emb / norms[:, None]
    w_hat = weight / weight.norm(dim=1, keepdim=True)
    cos = e @ w_hat.t()
    rows = torch.arange(len(labels))
    c = cos[rows, labels]
    kind, extra = cfg["type"], 0.0
    nontarget = cos
    if cfg.get("interclass_filter"):  # arcface_torch: non-target cosines above tau -> 0
        nontarget = torch.where(cos > cfg["interclass_filter"], 0.0, nontarget)
    if kind == "adaface":
        if cfg.get("clamp_nontarget", True):  # the authors clamp every cosine
            nontarget = nontarget.clamp(-1 + ADAFACE_EPS, 1 - ADAFACE_EPS)
        target, state = adaface(c, norms, cfg, state)
    elif kind == "curricularface":  # arXiv:2004.00288 Eq. 6-9
        t = cfg["ema"] * c.detach().mean().item() + (1 - cfg["ema"]) * state["t"]
        state = {**state, "t": t}
        c_d = c.detach()
        hard_above = torch.cos(torch.acos(c_d.clamp(-1, 1)) + cfg["m"])
        nontarget = torch.where(nontarget > hard_above[:, None], nontarget * (t + nontarget),
                                nontarget)
        target = arcface(c, cfg["m"])
    elif kind == "magface":
        target, extra = magface(c, norms, cfg)
    elif kind.startswith("elasticface_arc"):
        target = torch.cos(_acos(c) + elastic_margins(c, cfg, step, draw))
    elif kind.startswith("elasticface_cos"):
        target = c - elastic_margins(c, cfg, step, draw)
    else:
        target = arcface(c, cfg["m"])
    logits = cfg["s"] * nontarget.index_put((rows, labels), target)
    loss = F.cross_entropy(logits, labels) + extra
    if aux.get("intra"):  # ArcFace Eq. 5
        loss = loss + aux["intra"] * _acos(c).mean() / math.pi
    if aux.get("inter"):  # ArcFace Eq. 6, n = the classes the softmax runs over
        centres = w_hat[labels] @ w_hat.t()
        keep = torch.ones_like(centres, dtype=torch.bool).index_put((rows, labels),
                                                                     torch.tensor(False))
        total = torch.where(keep, _acos(centres), 0.0).sum()
        loss = loss - aux["inter"] * total / (math.pi * len(labels) * (weight.shape[0] - 1))
    if aux.get("triplet"):
        loss = loss + aux["triplet"] * triplet(e, labels, aux.get("triplet_margin", 0.35))
    return loss, state
