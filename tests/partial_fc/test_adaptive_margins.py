"""The adaptive margins (partial_fc.margins) on one process: config rules, the EMAs' state
(in the head's state_dict, frozen in eval), bf16 head state, and the margins' statistics in
``head.stats``. Exactness over ranks is ``test_margins_distributed``."""

import pytest
import torch

from partial_fc import PartialFC, build_margin
from partial_fc import metric_names as names
from partial_fc.aux_losses import AuxLosses
from partial_fc.margins.registry import margin_errors

D, C, N = 8, 13, 6
TYPES = ("adaface", "curricularface", "magface", "elasticface_arc", "elasticface_cos",
         "elasticface_arc_plus", "elasticface_cos_plus")


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, generator=g) * 5, torch.tensor([0, 3, 3, 7, 12, 5])


@pytest.mark.parametrize(("cfg", "needle"), [
    (dict(type="adaface", h=0.0), "margin.h=0.0: adaface needs a finite number > 0"),
    (dict(type="curricularface", ema=1.5), "margin.ema=1.5: curricularface needs a "
     "finite number > 0 and <= 1"),
    (dict(type="magface", l_a=120.0), "MagFace needs 0 < l_a < u_a"),
    (dict(type="magface", l_m=0.9), "MagFace needs 0 <= l_m <= u_m < pi"),
    (dict(type="elasticface_cos", sigma=-1.0), "margin.sigma=-1.0: elasticface_cos needs "
     "a finite number >= 0"),
    (dict(type="elasticface_cos_plus", elastic_sort=True), "margin.elastic_sort=True: not one "
     "of authors|paper"),
    (dict(type="magface", easy_margin=1), "margin.easy_margin=1: magface needs true or false"),
    (dict(type="cosface", interclass_filter=1.0), "margin.interclass_filter=1.0"),
])
def test_rules_name_key_and_value(cfg, needle):
    msgs = [msg for _, msg in margin_errors(cfg)]
    assert any(needle in msg for msg in msgs), msgs
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        build_margin(cfg)


def test_aux_loss_weights_must_be_non_negative():
    with pytest.raises(ValueError, match=r"loss.inter=-1.0: must be a finite number >= 0"):
        AuxLosses(inter=-1.0)


@pytest.mark.parametrize("kind", ["adaface", "curricularface"])
def test_ema_is_head_state_moves_in_training_only_and_resumes(kind):
    head = PartialFC(D, C, build_margin(dict(type=kind)), kernel="torch")
    emb, labels = _batch()
    keys = {"adaface": ("margin.batch_mean", "margin.batch_std"),
            "curricularface": ("margin.t",)}[kind]
    before = {k: head.state_dict()[k].clone() for k in keys}
    head(emb, labels)
    moved = {k: head.state_dict()[k].clone() for k in keys}
    assert all(not torch.equal(before[k], moved[k]) for k in keys)
    head.eval()
    head(emb * 2, labels)
    assert all(torch.equal(moved[k], head.state_dict()[k]) for k in keys)
    other = PartialFC(D, C, build_margin(dict(type=kind)), kernel="torch")
    other.load_state_dict(head.state_dict())
    assert all(torch.equal(moved[k], other.state_dict()[k]) for k in keys)


@pytest.mark.half
@pytest.mark.parametrize("kind", TYPES)
def test_bf16_state_trains_every_margin(kind):
    head = PartialFC(D, C, build_margin(dict(type=kind, s=16.0)), kernel="torch",
                     state_dtype=torch.bfloat16, aux_losses=AuxLosses(intra=1, inter=1, triplet=1))
    emb, labels = _batch()
    x = emb.requires_grad_()
    loss = head(x, labels)
    loss.backward()
    assert loss.isfinite() and x.grad.isfinite().all() and head.weight.grad.isfinite().all()
    assert head.weight.grad.dtype == torch.bfloat16


def test_statistics_reach_head_stats():
    emb, labels = _batch()
    ada = PartialFC(D, C, build_margin(dict(type="adaface")), kernel="torch")
    ada(emb, labels)
    norms = emb.norm(dim=1)
    assert ada.stats[names.NORM_MEAN] == pytest.approx(norms.mean().item(), rel=1e-6)
    assert ada.stats[names.NORM_STD] == pytest.approx(norms.std().item(), rel=1e-5)
    assert sum(ada.stats[k] for k in names.ADAFACE_ZHAT_BINS) == pytest.approx(1.0)
    cur = PartialFC(D, C, build_margin(dict(type="curricularface")), kernel="torch")
    cur(emb, labels)
    assert 0 < cur.stats[names.HARD_NEGATIVE_SHARE] <= 1
    assert cur.stats[names.CURRICULAR_T] == pytest.approx(
        0.01 * cur.stats[names.COS_TARGET_MEAN], rel=1e-5)
    mag = PartialFC(D, C, build_margin(dict(type="magface")), kernel="torch",
                    aux_losses=AuxLosses(triplet=0.5))
    mag(emb, labels)
    a = norms.clamp(10, 110)
    assert mag.stats[names.LOSS_MAGFACE_G] == pytest.approx(
        35 * (a / 110**2 + 1 / a).mean().item(), rel=1e-5)
    assert names.LOSS_TRIPLET in mag.stats and mag.stats[names.NORM_MAX] == pytest.approx(
        norms.max().item(), rel=1e-6)
