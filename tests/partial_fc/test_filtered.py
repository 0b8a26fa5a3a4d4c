"""The filtered backward of the Triton kernels (partial_fc.tiles.filtered) against the exact one.

In triton's interpreter (``TRITON_INTERPRET=1`` on CPU tensors, as test_tiles.py runs them)
on one rank's step as the head hands it over (plain ArcFace-less softmax at s = 64, bf16
operands, fp32 rows): ``coef``, ``target_grad`` and ``log p_target`` from the float64
statistics. Two softmaxes:

- flat (random rows, as at initialisation): nothing may be skipped, and the gradients are the
  exact path's, bit for bit;
- separated (trained-like: rows and samples in four clusters, a row block's samples of one
  cluster, one cluster with no sample; the non-target mass sits in the sample's own cluster,
  ``e^-50`` below it elsewhere): the class tiles of the other clusters are skipped, and the
  difference from the exact path stays within the derived bound, ``u m_i`` per row of
  ``grad_e`` and ``u sum_i m_i`` over the rows of ``grad_w`` (each row's change weighed by
  ``||w_k||``, since ``grad_w_k`` carries ``inv_k``).

Each runs with the interpreter's tiles; the separated one also with GEMM blocks twice the
``G'`` tiles' rows and half their columns (the skip flags regridded both ways). About 10
CPU-s in all.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from partial_fc.nontarget import NonTarget
from partial_fc.tiles.filtered import Skip, live_blocks, skip_bounds, unit_roundoff

if not torch.cuda.is_available():  # before triton's first import (test_tiles.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")
tm = pytest.importorskip("partial_fc.tiles.triton",
                         reason="triton is not installed (pip install triton)")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N, S, D, SCALE = 48, 160, 32, 64.0
TILES = {"interpreter": tm.INTERPRETER_TILES,
         "regridded": dataclasses.replace(tm.INTERPRETER_TILES, gemm=32, depth=8)}


def _step(separated: bool):
    """``e`` (bf16), ``w`` (fp32), ``inv``, targets and the backward's inputs of a one-rank
    plain softmax step, with ``m_i`` (float64) and ``log p_target``."""
    g = torch.Generator().manual_seed(7)
    if separated:
        centres = torch.linalg.qr(torch.randn(D, 4, generator=g, dtype=torch.float64))[0].T
        w = centres[torch.arange(S) * 4 // S] + 0.3 * torch.randn(S, D, generator=g,
                                                                    dtype=torch.float64) / D**0.5
        labels = torch.cat([torch.randint(40 * c, 40 * c + 40, (16,), generator=g)
                            for c in range(3)])  # row block c: cluster c; cluster 3: no sample
        e = F.normalize(w[labels], dim=1) + 0.3 * torch.randn(N, D, generator=g,
                                                              dtype=torch.float64) / D**0.5
    else:
        w = torch.randn(S, D, generator=g, dtype=torch.float64)
        labels = torch.randint(0, S, (N,), generator=g)
        e = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = (w * 0.05).float()
    e = F.normalize(e, dim=1).bfloat16()
    inv = 1.0 / w.double().norm(dim=1)
    logits = SCALE * (e.double() @ w.bfloat16().double().T) * inv
    lse = torch.logsumexp(logits, dim=1)
    log_p = logits.gather(1, labels[:, None])[:, 0] - lse
    coef = torch.full((N,), SCALE / N, dtype=torch.float64)
    args = [t.to(DEVICE) for t in (e, w, inv.float(), labels, lse.float(), coef.float(),
                                  ((log_p.exp() - 1) * coef).float())]
    mass = coef * -torch.expm1(log_p)  # m_i: the non-target mass of |dL/dcos|
    return args, mass, log_p


def _grads(args, tiles, skip=None):
    e, w, inv, labels, lse, coef, tgrad = args
    return tm.class_tile_grads(e, w, inv, labels, SCALE, lse, coef, tgrad, tiles=tiles,
                               skip=skip)


@pytest.mark.parametrize(("softmax", "tiles"), [("flat", "interpreter"),
                                                ("separated", "interpreter"),
                                                ("separated", "regridded")])
def test_the_filtered_backward_stays_within_the_rounding_it_is_bounded_by(softmax, tiles):
    args, mass, log_p = _step(softmax == "separated")
    u = unit_roundoff(torch.bfloat16)
    below = skip_bounds(args[5], log_p.float().to(DEVICE), S)
    assert torch.allclose(below.double().cpu(), u * mass / S, rtol=1e-5)
    counted = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    exact = _grads(args, TILES[tiles])
    filtered = _grads(args, TILES[tiles], Skip(below, counted))
    skipped, total = counted.tolist()
    assert total == 3 * 10  # row blocks x class tiles of 16
    if softmax == "flat":  # no entry 2^8 below the mean share: nothing skipped, nothing changed
        assert skipped == 0
        assert all(torch.equal(a, b) for a, b in zip(exact, filtered, strict=True))
        return
    # each row block keeps the 3 class tiles its cluster's 40 classes touch, skips the other 7
    assert skipped == 21
    d_e = (filtered[0] - exact[0]).double().norm(dim=1).cpu()
    assert bool((d_e <= u * mass).all()), float((d_e / (u * mass)).max())
    w_norm = args[1].double().norm(dim=1).cpu()
    d_w = ((filtered[1] - exact[1]).double().norm(dim=1).cpu() * w_norm).sum()
    assert d_w <= u * mass.sum(), float(d_w / (u * mass.sum()))
    assert exact[0].abs().max() > 1e3 * d_e.max()  # the bound is not vacuous here


def test_a_nontarget_transform_refuses_the_filter():
    args, _, log_p = _step(False)
    e, w, inv, labels, lse, coef, tgrad = args
    below = skip_bounds(coef, log_p.float().to(DEVICE), S)
    with pytest.raises(ValueError, match="plain non-target logits only"):
        tm.class_tile_grads(e, w, inv, labels, SCALE, lse, coef, tgrad,
                            nontarget=NonTarget(clamp=1e-3), skip=Skip(below))


def test_skip_flags_regrid_to_any_block_that_overlaps_a_kept_tile():
    live = torch.tensor([[1, 0, 0], [0, 0, 0], [0, 0, 1]], dtype=torch.int32)
    # rows 16 -> 32 (pairs of row blocks, padded), columns 16 -> 8 (each tile twice)
    assert live_blocks(live, (16, 32), (16, 8), (2, 6)).tolist() == [
        [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1]]
    assert live_blocks(live, (16, 16), (16, 32), (3, 2)).tolist() == [[1, 0], [0, 0], [0, 1]]


def test_the_head_hands_the_kernels_the_bound_only_when_asked(monkeypatch):
    """``PartialFC(grad_filter=True)``'s backward gives the kernels' seam ``skip`` with
    ``skip_i = u |coef_i| (1 - p_iy) / num_classes`` (fp32 operands here: ``u = 2^-24``), from
    the softmax's own ``p_iy``; by default it gives none (the exact backward). The first-use
    check before it (the seam is not the torch reference) compares the exact kernels."""
    from partial_fc import PartialFC, build_margin
    from partial_fc.tiles import ReferenceTiles

    seen = []

    class Recording:  # a kernel back-end: the reference, recording what the backward passes
        reference = ReferenceTiles(1 << 20)

        def class_tile_stats(self, *args, **kwargs):
            return self.reference.class_tile_stats(*args, **kwargs)

        def class_tile_grads(self, *args, skip=None, **kwargs):
            seen.append(skip)
            return self.reference.class_tile_grads(*args, **kwargs)

    g = torch.Generator().manual_seed(3)
    e, labels = torch.randn(8, 32, generator=g), torch.randint(0, 100, (8,), generator=g)
    for grad_filter in (False, True):
        head = PartialFC(32, 100, build_margin(dict(type="normface", s=64.0)), kernel="torch",
                         grad_filter=grad_filter)
        monkeypatch.setattr(head.tiles, "for_device", lambda device: Recording())
        head(e, labels).backward()
    assert seen[:3] == [None, None, None]  # check, step; check (exact, with grad_filter too)
    cos = F.normalize(e.double(), dim=1) @ F.normalize(head.weight.double(), dim=1).T
    p = torch.softmax(64.0 * cos, dim=1).gather(1, labels[:, None])[:, 0]
    want = unit_roundoff(torch.float32) * (64.0 / 8) * (1 - p) / 100
    assert len(seen) == 4 and torch.allclose(seen[3].below.double(), want, rtol=1e-4)
