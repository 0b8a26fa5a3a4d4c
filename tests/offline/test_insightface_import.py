"""``python -m launch.convert insightface-checkpoint``: arcface_torch output folders, written
here in its documented format (train_v2.py's keys; PartialFC_V2's split of the head rows; one
torch SGD over ``[{backbone}, {head weight}]``), become partial-fc runs that resume on another
number of ranks; bad folders get one line naming the file (exit 2)."""

from __future__ import annotations

import re

import pytest
import torch

from launch.convert import main as convert
from offline.insightface.backbones import our_key
from partial_fc.backbones import build_backbone
from partial_fc.partition import split_evenly
from tests.launch_helpers import ROOT

C, D = 23, 16


def _their_keys(state: dict) -> dict:
    """Our ViT keys under arcface_torch's names (iResNet keys are the same)."""
    def theirs(k: str) -> str:
        k = re.sub(r"^patch_embed\.", "patch_embed.proj.", k)
        return re.sub(r"\.mlp\.0\.", ".mlp.fc1.", re.sub(r"\.mlp\.2\.", ".mlp.fc2.", k))
    out = {theirs(k): v for k, v in state.items()}
    assert all(our_key(k) in state for k in out)  # the mapping under test inverts this one
    return out


def write_arcface_torch_run(folder, world, step=6, epoch=2, seed=0, network="iresnet_tiny",
                            rename=lambda k: k):
    """What train_v2.py (save_all_states=True) leaves after ``epoch`` epochs of ``step`` steps,
    ranks 0..world-1, backbone keys as ``rename`` gives them; returns (backbone state, head
    [C, D], head momentum [C, D]); every backbone momentum is the parameter's index."""
    torch.manual_seed(seed)
    backbone = build_backbone(network, embedding_size=D)
    head = torch.randn(C, D)
    momentum = torch.randn(C, D)
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        start, stop = split_evenly(C, world, rank)  # PartialFC_V2's num_local / class_start
        weight = torch.nn.Parameter(head[start:stop].clone())
        opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": [weight]}],
                              lr=0.0, momentum=0.9, weight_decay=5e-4)
        for p in [*backbone.parameters(), weight]:
            p.grad = torch.zeros_like(p)
        opt.step()  # lr 0: creates every momentum buffer, in torch's own format, moves nothing
        for i, p in enumerate(backbone.parameters()):
            opt.state[p]["momentum_buffer"].copy_(torch.full_like(p, float(i)))
        opt.state[weight]["momentum_buffer"].copy_(momentum[start:stop])
        torch.save({
            "epoch": epoch, "global_step": step,
            "state_dict_backbone": {rename(k): v for k, v in backbone.state_dict().items()},
            "state_dict_softmax_fc": {"weight": weight.detach()},
            "state_optimizer": opt.state_dict(),
            "state_lr_scheduler": {"total_iters": step + 4, "warmup_iters": 0, "power": 1.0,
                                   "base_lrs": [0.1, 0.1], "last_epoch": step,
                                   "_step_count": step + 1},
        }, folder / f"checkpoint_gpu_{rank}.pt")
    torch.save(backbone.state_dict(), folder / "model.pt")
    return backbone.state_dict(), head, momentum


def _recipe(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"base: {ROOT / 'configs' / 'smoke.yaml'}\nbackbone:\n  name: iresnet_tiny\n"
                    f"engine:\n  type: ddp\ndata:\n  source: synthetic\n  num_classes: {C}\n"
                    "  synthetic_images_per_class: 2\n")
    return path


@pytest.mark.parametrize("world", [1, 2, 4])
def test_shards_import_in_class_order_with_their_momentum(tmp_path, world, one_rank_group):
    from trainer import checkpoint
    from trainer.config import load_config

    src, out = tmp_path / f"arcface{world}", tmp_path / "run"
    backbone, head, momentum = write_arcface_torch_run(src, world)
    assert convert(["insightface-checkpoint", str(src), str(out), "--config",
                    str(_recipe(tmp_path))]) == 0
    cfg = load_config(out / "config.yaml", resolve=False)
    assert cfg.margin.gradient == "straight_through" and cfg.train.max_steps == 10
    assert cfg.schedule.power == 1.0 and cfg.data.num_classes == C
    engine = _engine(cfg)
    meta = checkpoint.load(checkpoint.find_verified(out), engine)
    assert meta.step == 6 and meta.loaders[0]["epoch"] == 2
    assert torch.equal(engine.head.weight.detach(), head)  # rows in class order
    assert torch.equal(engine.head_optimizer.state[engine.head.weight]["momentum_buffer"],
                       momentum)
    for k, v in engine.backbone.state_dict().items():
        assert torch.equal(v, backbone[k]), k
    for i, p in enumerate(engine.backbone.parameters()):
        assert torch.all(engine.optimizer.state[p]["momentum_buffer"] == i)


def _engine(cfg):
    from partial_fc import PartialFC, build_margin
    from trainer.dist import attach
    from trainer.engine import Engine

    backbone = build_backbone(**cfg.backbone.build_kwargs())
    head = PartialFC(D, C, build_margin(cfg.margin_kwargs()), **cfg.head.partial_fc_kwargs())
    return Engine(cfg, backbone, head, attach(torch.device("cpu")), total_steps=10,
                  warmup_steps=0)


@pytest.mark.slow
def test_a_two_rank_import_resumes_on_one_rank(tmp_path, capsys):
    from launch.train import main as train

    src, out = tmp_path / "arcface", tmp_path / "run"
    write_arcface_torch_run(src, 2)
    assert convert(["insightface-checkpoint", str(src), str(out), "--config",
                    str(_recipe(tmp_path))]) == 0
    assert train(["--config", str(out / "config.yaml"), "train.batch_size=4",
                  "data.num_workers=0", "log.every=1", "log.progress=false",
                  "log.hist_every=0"]) == 0
    err = capsys.readouterr()
    assert "at step 6 (saved on 1 ranks)" in err.out + err.err
    assert (out / "checkpoints" / "step-00000010").is_dir()  # trained steps 7..10


def test_a_missing_shard_is_named(tmp_path, capsys):
    src = tmp_path / "arcface"
    write_arcface_torch_run(src, 4)
    (src / "checkpoint_gpu_2.pt").unlink()
    assert convert(["insightface-checkpoint", str(src), str(tmp_path / "run")]) == 2
    line = capsys.readouterr().err.strip()
    assert line == (f"import error: {src / 'checkpoint_gpu_2.pt'}: missing (found ranks "
                    "[0, 1, 3]; an arcface_torch run writes one per rank)")


def test_a_wrong_sized_shard_is_named(tmp_path, capsys):
    src = tmp_path / "arcface"
    write_arcface_torch_run(src, 2)
    ckpt = torch.load(src / "checkpoint_gpu_1.pt", weights_only=True)
    ckpt["state_dict_softmax_fc"]["weight"] = ckpt["state_dict_softmax_fc"]["weight"][:-1]
    torch.save(ckpt, src / "checkpoint_gpu_1.pt")
    assert convert(["insightface-checkpoint", str(src), str(tmp_path / "run"), "--config",
                    str(_recipe(tmp_path))]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"import error: {src / 'checkpoint_gpu_1.pt'}: state_dict_softmax_fc.weight "
                   "is (10, 16); rank 1 of 2 holds classes [12, 23) of 23, so expected "
                   "(11, 16) (PartialFC_V2's split)")


def test_another_architecture_is_named(tmp_path, capsys):
    src = tmp_path / "arcface"
    src.mkdir()
    vit = build_backbone("vit_t", embedding_size=D, depth=1)
    torch.save(_their_keys(vit.state_dict()), src / "model.pt")
    assert convert(["insightface-checkpoint", str(src), str(tmp_path / "run"), "--config",
                    str(_recipe(tmp_path))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"import error: {src / 'model.pt'}: not a state_dict of "
                          "'iresnet_tiny'") and "\n" not in err


def test_a_vit_model_alone_becomes_a_run_to_evaluate_and_fine_tune(tmp_path):
    from trainer.checkpoint.backbone import load_backbone
    from trainer.config import load_config

    src, out = tmp_path / "arcface", tmp_path / "run"
    src.mkdir()
    torch.manual_seed(0)
    vit = build_backbone("vit_t", embedding_size=D, depth=1)
    theirs = _their_keys(vit.state_dict())
    theirs["mask_token"] = torch.zeros(1, 1, 256)  # arcface_torch's ViT always holds one
    torch.save(theirs, src / "model.pt")
    recipe = tmp_path / "vit.yaml"
    recipe.write_text(f"base: {ROOT / 'configs' / 'smoke.yaml'}\nbackbone:\n  name: vit_t\n"
                      "  depth: 1\n")
    assert convert(["insightface-checkpoint", str(src), str(out), "--config", str(recipe)]) == 0
    model, _ = load_backbone(out)  # what launch.evaluate and launch.export read
    for k, v in model.state_dict().items():
        assert torch.equal(v, vit.state_dict()[k]), k
    cfg = load_config(out / "config.yaml", resolve=False)
    assert cfg.backbone.weights is not None and cfg.run_dir == out / "finetune"


@pytest.mark.slow
def test_model_alone_with_its_py_config_and_without_any(tmp_path):
    """The network comes from its config (``r18``), or from the keys alone (a ViT-T)."""
    from trainer.checkpoint.backbone import load_backbone

    torch.manual_seed(0)
    r18 = build_backbone("iresnet18", embedding_size=D)
    (tmp_path / "r18").mkdir()
    torch.save(r18.state_dict(), tmp_path / "r18" / "model.pt")
    config = tmp_path / "configs" / "r18.py"
    config.parent.mkdir()
    config.write_text(f"config = dict()\nconfig.network = 'r18'\nconfig.embedding_size = {D}\n"
                      "config.margin_list = (1.0, 0.5, 0.0)\n")
    assert convert(["insightface-checkpoint", str(tmp_path / "r18"), str(tmp_path / "a"),
                    "--config", str(config)]) == 0
    model, cfg = load_backbone(tmp_path / "a")
    assert cfg["backbone"]["name"] == "iresnet18" and cfg["margin"]["type"] == "arcface"
    assert all(torch.equal(v, r18.state_dict()[k]) for k, v in model.state_dict().items())

    vit = build_backbone("vit_t", embedding_size=D)
    theirs = {**_their_keys(vit.state_dict()), "mask_token": torch.zeros(1, 1, 256)}
    (tmp_path / "vit").mkdir()
    torch.save(theirs, tmp_path / "vit" / "model.pt")
    assert convert(["insightface-checkpoint", str(tmp_path / "vit"), str(tmp_path / "b")]) == 0
    model, cfg = load_backbone(tmp_path / "b")
    assert cfg["backbone"]["name"] == "vit_t" and cfg["margin"]["gradient"] == "straight_through"


def test_its_mbf_maps_position_by_position_with_its_momentum(tmp_path, one_rank_group):
    """Its MobileFaceNet names its modules otherwise (``layers.N.layers...``); only the order
    and the shapes carry over, here under made-up names."""
    from trainer import checkpoint
    from trainer.config import load_config

    src, out = tmp_path / "mbf", tmp_path / "run"
    def rename(key):  # body.0.0.weight -> theirs.body_0_0.weight: the last name kept
        return "theirs." + key.replace(".", "_", key.count(".") - 1)

    backbone, head, _ = write_arcface_torch_run(src, 2, network="mbf", rename=rename)
    recipe = tmp_path / "mbf.yaml"
    recipe.write_text(_recipe(tmp_path).read_text().replace("iresnet_tiny", "mbf"))
    assert convert(["insightface-checkpoint", str(src), str(out), "--config", str(recipe)]) == 0
    engine = _engine(load_config(out / "config.yaml", resolve=False))
    checkpoint.load(checkpoint.find_verified(out), engine)
    assert torch.equal(engine.head.weight.detach(), head)
    for k, v in engine.backbone.state_dict().items():
        assert torch.equal(v, backbone[k]), k
    for i, p in enumerate(engine.backbone.parameters()):
        assert torch.all(engine.optimizer.state[p]["momentum_buffer"] == i)
