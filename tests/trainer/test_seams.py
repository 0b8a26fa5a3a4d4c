"""The declared seams (trainer/seams.py) and the faults of tools/chaos that attach to them.

A fault that names a seam nobody declares fails to attach; a declared seam the training code
stopped firing is caught by a tiny run on a 1-rank group that must fire every one of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tools.testbed.harness import FAULTS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_seams():
    from trainer import seams

    seams.detach_all()
    yield seams
    seams.detach_all()


def test_attach_refuses_an_undeclared_seam(clean_seams):
    with pytest.raises(KeyError, match="no seam named 'head_loss'; declared: .*head-loss"):
        clean_seams.attach("head_loss", lambda loss, rank: None)
    assert all(not seam.hooks for seam in clean_seams.SEAMS.values())


def test_a_seam_passes_its_value_through_its_hooks_in_order(clean_seams):
    seen = []
    detach = clean_seams.attach("head-loss", lambda v, rank: seen.append(("a", v, rank)))
    clean_seams.attach("head-loss", lambda v, rank: v * 2)
    clean_seams.attach("head-loss", lambda v, rank: seen.append(("c", v, rank)))
    assert clean_seams.HEAD_LOSS(3, rank=1) == 6
    assert seen == [("a", 3, 1), ("c", 6, 1)]
    detach()
    assert clean_seams.HEAD_LOSS(5, rank=0) == 10 and len(seen) == 3


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_every_chaos_fault_attaches_one_hook_to_one_declared_seam(clean_seams, fault):
    FAULTS[fault]()  # attach raises KeyError on a seam name that is not declared
    hooked = {name: len(seam.hooks) for name, seam in clean_seams.SEAMS.items() if seam.hooks}
    assert list(hooked.values()) == [1], hooked


def test_the_nan_and_disk_full_faults_do_what_their_names_say(clean_seams, tmp_path):
    """Fired by hand: the third micro-batch loss on rank 1 becomes NaN, once; from the
    second checkpoint step on every write fails with ENOSPC."""
    import errno

    FAULTS["nan-rank1-step3"]()
    ranks = [0, 1, 1, 0, 1, 1]
    losses = [clean_seams.HEAD_LOSS(torch.tensor(1.0), rank=r) for r in ranks]
    assert [bool(torch.isfinite(x)) for x in losses] == [True, True, True, True, False, True]
    clean_seams.detach_all()
    FAULTS["disk-full-at-2"]()
    clean_seams.CHECKPOINT_WRITE(tmp_path / "state", step=1, rank=0)
    clean_seams.CHECKPOINT_WRITE(tmp_path / "rng-0.pt", step=1, rank=0)
    with pytest.raises(OSError) as full:
        clean_seams.CHECKPOINT_WRITE(tmp_path / "state", step=2, rank=1)
    assert full.value.errno == errno.ENOSPC and full.value.filename == str(tmp_path / "state")


def test_chaos_harness_assigns_no_attribute_of_production_code():
    """The faults go through seams: no ``module.attr = ...`` (an object's own ``self.x``
aside) and no ``setattr`` in tools/chaos."""
    found = []
    for path in sorted((ROOT / "tools" / "chaos").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
            found += [f"{path.name}:{node.lineno}" for t in targets
                      if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) != "self"]
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
                found.append(f"{path.name}:{node.lineno} setattr")
    assert not found, found


def test_a_short_run_fires_every_seam(clean_seams, one_rank_group, tmp_path):
    """build -> one step -> the same checkpoint saved twice: each seam fires, with the
    arguments its declaration names."""
    from launch_helpers import ROOT as TESTS_ROOT

    from trainer import checkpoint
    from trainer.build import build
    from trainer.config import load_config
    from trainer.dist import attach

    fired: dict[str, list] = {name: [] for name in clean_seams.SEAMS}
    for name in clean_seams.SEAMS:
        clean_seams.attach(name, lambda value, _n=name, **ctx: fired[_n].append((value, ctx)))
    cfg = load_config(TESTS_ROOT / "configs" / "smoke.yaml", [
        "data.source=synthetic", "data.num_classes=8", "train.batch_size=4", "train.max_steps=1",
        "engine.type=ddp", "backbone.embedding_size=16", f"output={tmp_path}",
        "log.wandb=disabled"])
    run = build(cfg, attach(torch.device("cpu")))
    images, labels = next(iter(run.loader))
    run.engine.step(0, [(images, labels)])
    for _ in range(2):
        checkpoint.save(cfg.run_dir, 1, run.engine, checkpoint.RunRecord(), keep=2)

    assert all(fired.values()), [name for name, got in fired.items() if not got]  # never fired
    ((backbone, ctx),) = fired["backbone-built"]
    assert backbone is run.engine.backbone and ctx == {"rank": 0}
    ((loss, ctx),) = fired["head-loss"]
    assert loss.ndim == 0 and loss.requires_grad and ctx == {"rank": 0}
    tmp = Path(cfg.run_dir) / "checkpoints" / ".tmp-step-00000001"
    parts = [tmp / name for name in ("state", "rng-0.pt", "backbone.pt", "meta.json")]
    assert fired["checkpoint-write"] == [(p, {"step": 1, "rank": 0}) for p in parts * 2]
    assert fired["checkpoint-replaced"] == [(tmp.parent / "step-00000001", {})]
    run.log.close_unused()
