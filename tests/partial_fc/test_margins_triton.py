"""The margins the Triton class tiles run (the target-only ones: MagFace, ElasticFace,
ArcFace's auxiliary losses; AdaFace with and without its non-target clamp) equal the torch
path there; the other non-target transforms (CurricularFace, the inter-class filter) take the
torch path with one start-up line saying why. ``test_tiles.py`` checks the clamp itself on
cosines past its band.

Without CUDA the kernels run in triton's interpreter (``TRITON_INTERPRET=1``, set before the
first import of triton, as ``test_tiles`` does).
"""

import os

import pytest
import torch

from partial_fc import PartialFC, build_margin
from partial_fc.aux_losses import AuxLosses
from partial_fc.tiles import ReferenceTiles

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("partial_fc.tiles.triton", reason="triton is not installed")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
C, D, N = 40, 24, 10
ON_TRITON = {
    "adaface": (dict(type="adaface", s=16.0), {}),
    "adaface_target_clamp": (dict(type="adaface", s=16.0, clamp_nontarget=False), {}),
    "magface": (dict(type="magface", s=16.0), {}),
    "elasticface_arc_plus": (dict(type="elasticface_arc_plus", s=16.0), {}),
    "arcface_aux": (dict(type="arcface", s=16.0), dict(intra=0.5, inter=0.5, triplet=0.5)),
}


def _run(cfg, aux, kernel, emb, weight, labels):
    head = PartialFC(D, C, build_margin(cfg), kernel=kernel,
                     aux_losses=AuxLosses(**aux)).to(DEVICE)
    with torch.no_grad():
        head.weight.copy_(weight)
    x = emb.clone().requires_grad_()
    loss = head(x, labels)
    loss.backward()
    return loss.detach(), x.grad, head.weight.grad, head


@pytest.mark.parametrize("name", sorted(ON_TRITON))
def test_margins_run_on_the_triton_tiles(name):
    g = torch.Generator().manual_seed(0)
    emb = (torch.randn(N, D, generator=g) * torch.linspace(2, 8, N)[:, None]).to(DEVICE)
    weight = torch.randn(C, D, generator=g).to(DEVICE)
    labels = torch.tensor([0, 5, 5, 9, 17, 23, 31, 39, 0, 12], device=DEVICE)
    cfg, aux = ON_TRITON[name]
    want = _run(cfg, aux, "torch", emb, weight, labels)
    got = _run(cfg, aux, "triton", emb, weight, labels)
    assert not isinstance(got[3].tiles.for_device(DEVICE), ReferenceTiles)
    assert got[3].take_notes() == []
    for a, b in zip(got[:3], want[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("cfg", [dict(type="curricularface"),
                                 dict(type="adaface", interclass_filter=0.3),
                                 dict(type="arcface", interclass_filter=0.3)])
def test_nontarget_transforms_take_the_torch_path_and_say_so(cfg):
    head = PartialFC(D, C, build_margin(cfg), kernel="triton")
    assert isinstance(head._shard(torch.zeros(2, D), None, torch.zeros(2, dtype=torch.long)
                                  ).tiles, ReferenceTiles)
    (note,) = head.take_notes()
    assert note.startswith("head: ") and "torch path (head.kernel=torch)" in note, note
    assert PartialFC(D, C, build_margin(cfg), kernel="torch").take_notes() == []
