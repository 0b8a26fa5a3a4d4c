"""Every margin runs on the Triton class tiles and equals the torch path there: the
target-only ones (MagFace, ElasticFace, ArcFace's auxiliary losses) and those with a
non-target transform (AdaFace's clamp, CurricularFace's hard-negative modulation, the
inter-class filter on any type); ``head.kernel=auto`` on CUDA takes the kernels for them with
no start-up line. ``test_tiles.py`` checks each transform itself on the kernels.

Without CUDA the kernels run in triton's interpreter (``TRITON_INTERPRET=1``, set before the
first import of triton, as ``test_tiles`` does).
"""

import os

import pytest
import torch

from partial_fc import PartialFC, build_margin
from partial_fc.aux_losses import AuxLosses
from partial_fc.metric_names import HARD_NEGATIVE_SHARE
from partial_fc.tiles import ReferenceTiles, selfcheck

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
tm = pytest.importorskip("partial_fc.tiles.triton", reason="triton is not installed")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
C, D, N = 40, 24, 10
ON_TRITON = {
    "adaface": (dict(type="adaface", s=16.0), {}),
    "adaface_target_clamp": (dict(type="adaface", s=16.0, clamp_nontarget=False), {}),
    "magface": (dict(type="magface", s=16.0), {}),
    "elasticface_arc_plus": (dict(type="elasticface_arc_plus", s=16.0), {}),
    "arcface_aux": (dict(type="arcface", s=16.0), dict(intra=0.5, inter=0.5, triplet=0.5)),
    "curricularface": (dict(type="curricularface", s=16.0), {}),
    "arcface_filter": (dict(type="arcface", s=16.0, interclass_filter=0.3), {}),
    "adaface_filter": (dict(type="adaface", s=16.0, interclass_filter=0.3), {}),
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
    if cfg["type"] == "curricularface":  # the hard negatives the kernels counted
        share = got[3].stats[HARD_NEGATIVE_SHARE]
        assert 0 < share < 1 and share == want[3].stats[HARD_NEGATIVE_SHARE]


@pytest.mark.parametrize("cfg", [dict(type="curricularface", s=16.0),
                                 dict(type="curricularface", s=16.0, interclass_filter=0.3),
                                 dict(type="arcface", s=16.0, interclass_filter=0.3)])
def test_auto_on_cuda_runs_the_nontarget_transforms_on_the_kernels(cfg, monkeypatch):
    """``head.kernel=auto`` as on a CUDA device (``select`` answering the Triton module, the
    seam ``test_kernel_selfcheck.py`` fakes): both tile passes reach the kernels with the
    margin's non-target transform, and the head says nothing at start-up."""
    real = selfcheck.select
    monkeypatch.setattr(selfcheck, "select", lambda kernel, device, budget:
                        tm if kernel == "auto" else real(kernel, device, budget))
    seen = []

    def spy(name):
        run = getattr(tm, name)

        def call(*args, **kwargs):
            seen.append((name, kwargs.get("nontarget")))
            return run(*args, **kwargs)
        return call
    for name in ("class_tile_stats", "class_tile_grads"):
        monkeypatch.setattr(tm, name, spy(name))
    head = PartialFC(D, C, build_margin(cfg), kernel="auto").to(DEVICE)
    assert head.take_notes() == []
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, D, generator=g).to(DEVICE).requires_grad_()
    head(x, torch.randint(0, C, (N,), generator=g).to(DEVICE)).backward()
    transformed = {name for name, step in seen if step is not None}
    assert transformed == {"class_tile_stats", "class_tile_grads"}, seen
    assert all((step.tau is not None) == ("interclass_filter" in cfg)
               and (step.hard_above is not None) == (cfg["type"] == "curricularface")
               for _, step in seen if step is not None)
    assert head.take_notes() == []
