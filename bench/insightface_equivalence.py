"""Benchmark: partial-fc against insightface arcface_torch's own code, step for step.

    .venv/bin/python bench/insightface_equivalence.py --insightface DIR [--steps 30]
        [--batch 4] [--classes 32] [--size 112] [--configs NAME ...] [--json FILE]

DIR is a checkout of https://github.com/deepinsight/insightface (fetched by the user; nothing
is downloaded). On 2 gloo CPU ranks, each configuration trains three models from the same
initial weights on the same batches:

- arcface_torch: its ``PartialFC_V2``, ``CombinedMarginLoss(64, m1, m2, m3)``, iresnet
  (``IResNet(IBasicBlock, [1, 1, 1, 1])``), one ``torch.optim.SGD`` over backbone and head,
  ``PolynomialLRWarmup``, under DDP as train_v2.py wraps it (``broadcast_buffers=False``,
  by this torch's name: ``trainer.engine.ddp.buffer_sync``; ``find_unused_parameters``,
  static graph) and its fp32 step (backward, clip at 5, step);
- partial-fc: ``trainer.engine.Engine`` (the trainer's own step) on the same iresnet, with
  the options a converted arcface_torch config sets (``offline.insightface.config``);
- partial-fc again, its first gradients multiplied by ``1 +- 5e-7`` (random signs): how far
  float noise of that size carries over the same steps.

Their source files are loaded with only these changes, each printed: ``.cuda()`` removed
(CPU), and ``PolynomialLRWarmup``'s ``verbose=`` argument dropped (torch 2.13's
``_LRScheduler`` no longer takes it). ``--size 16`` sets the class attribute
``IResNet.fc_scale = 1`` (and partial-fc's ``_FEATURE_MAP`` to 1): the same networks on
16 x 16 images, whose last feature map is 1 x 1, 49x cheaper than 112 x 112 on a loaded CPU.
Deviations from train_v2.py: no ``fp16_compress_hook`` on either side (its fp16 rounding of
two implementations' gradients, which differ in the last fp32 bits, would dominate the
comparison; ``engine.grad_compression=fp16`` is the option), fp32 instead of fp16 autocast.
At r < 1 both sides use the sample arcface_torch drew (partial-fc's sampler is patched to
return ``PartialFC_V2.weight_index``): the aligned sample.

Reported per configuration: the relative difference of the step-1 gradients (backbone,
head), the largest relative loss difference over the steps and ``1 -`` the cosine of the
final backbone and head weights, for partial-fc against arcface_torch and partial-fc against
its perturbed self; then both loss-difference curves. Prints markdown; asserts nothing; not
a test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import types
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LR, MOMENTUM, DECAY, CLIP, EMBEDDING, PERTURB = 0.1, 0.9, 5e-4, 5.0, 64, 5e-7
CONFIGS = {  # name: (margin_list, partial-fc margin.gradient, sample rate, head.update)
    "CosFace r=1": ((1.0, 0.0, 0.4), "straight_through", 1.0, "dense"),
    "ArcFace straight_through r=1": ((1.0, 0.5, 0.0), "straight_through", 1.0, "dense"),
    "ArcFace exact r=1": ((1.0, 0.5, 0.0), "exact", 1.0, "dense"),
    "CosFace r=0.5": ((1.0, 0.0, 0.4), "straight_through", 0.5, "dense"),
    "ArcFace straight_through r=0.5": ((1.0, 0.5, 0.0), "straight_through", 0.5, "dense"),
    "ArcFace exact r=0.5": ((1.0, 0.5, 0.0), "exact", 0.5, "dense"),
    # Not run by default: partial-fc's own head update at r < 1, to show what dense changes.
    "CosFace r=0.5 head.update=sampled": ((1.0, 0.0, 0.4), "straight_through", 0.5,
                                          "sampled"),
}
DEFAULT = list(CONFIGS)[:6]


def load_arcface_torch(root: Path) -> tuple[dict[str, types.ModuleType], list[str]]:
    """arcface_torch's modules, loaded from their files with the listed patches."""
    base = root / "recognition" / "arcface_torch"
    if not (base / "partial_fc_v2.py").is_file():
        raise SystemExit(f"error: {base / 'partial_fc_v2.py'}: not found; --insightface must "
                         "name a checkout of deepinsight/insightface")
    modules, patches = {}, []
    for name, rel in (("partial_fc_v2", "partial_fc_v2.py"), ("losses", "losses.py"),
                      ("lr_scheduler", "lr_scheduler.py"), ("iresnet", "backbones/iresnet.py")):
        lines = (base / rel).read_text().splitlines(keepends=True)
        for i, line in enumerate(lines):
            if ".cuda()" in line:
                lines[i] = line.replace(".cuda()", "")
                patches.append(f"{rel}:{i + 1}: .cuda() removed")
            if "verbose=verbose)" in line:
                lines[i] = line.replace(", verbose=verbose)", ")")
                patches.append(f"{rel}:{i + 1}: verbose= dropped (torch 2.13's _LRScheduler)")
        module = types.ModuleType(f"arcface_torch_{name}")
        exec(compile("".join(lines), str(base / rel), "exec"), module.__dict__)  # noqa: S102
        modules[name] = module
    return modules, patches


def _batch(step: int, rank: int, world: int, per_rank: int, classes: int, size: int):
    """This rank's slice of global batch ``step``: uint8 images and labels."""
    gen = torch.Generator().manual_seed(1000 + step)
    images = torch.randint(0, 256, (world * per_rank, 3, size, size), generator=gen,
                           dtype=torch.uint8)
    labels = torch.randint(0, classes, (world * per_rank,), generator=gen)
    lo = rank * per_rank
    return images[lo:lo + per_rank], labels[lo:lo + per_rank]


def _ours(theirs_backbone, theirs_head, margin_list, gradient, rate, update, args, shared):
    """A partial-fc Engine holding arcface_torch's initial weights, as converted."""
    from offline.insightface.config import LOSS_CAP, margin_of
    from partial_fc import PartialFC, build_margin
    from partial_fc.backbones.iresnet import IResNet
    from trainer.config import Config
    from trainer.dist import attach
    from trainer.engine import Engine

    backbone = IResNet((1, 1, 1, 1), (64, 128, 256, 512), embedding_size=EMBEDDING)
    backbone.load_state_dict(theirs_backbone.state_dict())
    margin = {**margin_of(list(margin_list), "bench", []), "gradient": gradient}
    head = PartialFC(EMBEDDING, args.classes, build_margin(margin), sample_rate=rate,
                     loss_cap=LOSS_CAP)
    with torch.no_grad():
        head.weight.copy_(theirs_head.weight)
    cfg = Config.model_validate({
        "optim": {"lr": LR, "momentum": MOMENTUM, "weight_decay": DECAY},
        "train": {"batch_size": args.batch, "clip_grad_norm": CLIP},
        "schedule": {"type": "poly", "power": 1.0},
        "head": {"sample_rate": rate, "update": update},
        "engine": {"type": "ddp", "broadcast_buffers": False}})
    engine = Engine(cfg, backbone, head, attach(torch.device("cpu")),
                    total_steps=args.steps, warmup_steps=0)
    _watch(engine, shared)
    return engine


def _watch(engine, shared) -> None:
    """Keep (and, for the perturbed run, scale) the first step's gradients as the
    optimizers see them (after clipping)."""
    shared.setdefault("grads", {})
    key = id(engine)

    def backbone_step(orig):
        def step(*a, **k):
            if key not in shared["grads"]:
                params = [p for p in engine.backbone.parameters() if p.grad is not None]
                if shared.get("perturb") == key:
                    gen = torch.Generator().manual_seed(7)
                    for p in params:
                        sign = torch.randint(0, 2, p.shape, generator=gen) * 2 - 1
                        p.grad.mul_(1 + PERTURB * sign)
                shared["grads"][key] = {"backbone": [p.grad.clone() for p in params]}
            return orig(*a, **k)
        return step

    def head_step(orig):
        def step(rows, *a, **k):
            grads = shared["grads"].get(key)
            if grads is not None and "head" not in grads:
                grad = engine.head.weight.grad
                if shared.get("perturb") == key:
                    grad.mul_(1 + PERTURB)
                grads["head"] = grad.to_dense().clone()
            return orig(rows, *a, **k)
        return step

    engine.optimizer.step = backbone_step(engine.optimizer.step)
    engine.head_optimizer.step = head_step(engine.head_optimizer.step)


def _run_config(name, modules, args, rank, world):
    margin_list, gradient, rate, update = CONFIGS[name]
    import partial_fc.head as head_module
    from trainer.engine.ddp import buffer_sync

    torch.manual_seed(0)  # train_v2: one seed, the same backbone and head shards everywhere
    their_backbone = modules["iresnet"].IResNet(modules["iresnet"].IBasicBlock, [1, 1, 1, 1],
                                                num_features=EMBEDDING)
    their_head = modules["partial_fc_v2"].PartialFC_V2(
        modules["losses"].CombinedMarginLoss(64, *margin_list), EMBEDDING, args.classes,
        rate, False)
    shared: dict = {}
    setting = (margin_list, gradient, rate, update, args, shared)
    ours = _ours(their_backbone, their_head, *setting)
    perturbed = _ours(their_backbone, their_head, *setting)
    shared["perturb"] = id(perturbed)
    ddp = torch.nn.parallel.DistributedDataParallel(
        their_backbone, **buffer_sync(False), bucket_cap_mb=16, find_unused_parameters=True)
    ddp._set_static_graph()
    opt = torch.optim.SGD([{"params": ddp.parameters()}, {"params": their_head.parameters()}],
                          lr=LR, momentum=MOMENTUM, weight_decay=DECAY)
    sched = modules["lr_scheduler"].PolynomialLRWarmup(opt, warmup_iters=0,
                                                       total_iters=args.steps)

    def aligned(labels, class_start, num_local, *_):  # PartialFC_V2's own sample
        index = their_head.weight_index
        local = labels - class_start
        own = (local >= 0) & (local < num_local)
        pos = torch.searchsorted(index, local.clamp(0, num_local - 1))
        return index, torch.where(own, pos, -1)

    head_module.sample_classes = aligned
    losses = {"theirs": [], "ours": [], "perturbed": []}
    theirs_grads = None
    for step in range(args.steps):
        images, labels = _batch(step, rank, world, args.batch, args.classes, args.size)
        loss = their_head(ddp(images.float() / 127.5 - 1.0), labels.clone())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
        if theirs_grads is None:
            theirs_grads = {"backbone": [p.grad.clone() for p in their_backbone.parameters()
                                         if p.grad is not None],
                            "head": their_head.weight.grad.clone()}
        opt.step()
        opt.zero_grad()
        sched.step()
        losses["theirs"].append(loss.item())
        for key, engine in (("ours", ours), ("perturbed", perturbed)):
            losses[key].append(engine.step(step, [(images, labels)]).loss)
    ours_grads, pert_grads = shared["grads"][id(ours)], shared["grads"][id(perturbed)]
    final = {"theirs": (their_backbone, their_head.weight), "ours":
             (ours.backbone, ours.head.weight), "perturbed": (perturbed.backbone,
                                                              perturbed.head.weight)}
    return {"losses": losses,
            "grad": {"ours": _grad_errors(ours_grads, theirs_grads),
                     "perturbed": _grad_errors(pert_grads, ours_grads)},
            "cosine": {"ours": _cosines(final["ours"], final["theirs"]),
                       "perturbed": _cosines(final["perturbed"], final["ours"])}}


def _gather_rows(rows: torch.Tensor) -> torch.Tensor:
    parts = [torch.zeros_like(rows) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, rows.detach().contiguous())
    return torch.cat(parts)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _grad_errors(got, want) -> dict[str, float]:
    backbone = _relative(torch.cat([g.flatten() for g in got["backbone"]]),
                         torch.cat([g.flatten() for g in want["backbone"]]))
    return {"backbone": backbone,
            "head": _relative(_gather_rows(got["head"]), _gather_rows(want["head"]))}


def _cosines(got, want) -> dict[str, float]:
    flat = [torch.cat([p.detach().double().flatten() for p in m.parameters()])
            for m in (got[0], want[0])]
    heads = [_gather_rows(w).double().flatten() for w in (got[1], want[1])]
    cos = torch.nn.functional.cosine_similarity
    return {"backbone": cos(*flat, dim=0).item(), "head": cos(*heads, dim=0).item()}


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    modules, _ = load_arcface_torch(Path(args.insightface))
    if args.size != 112:
        import partial_fc.backbones.iresnet as ours

        side = args.size // 16  # four stride-2 stages after a stride-1 stem
        modules["iresnet"].IResNet.fc_scale = side * side
        ours._FEATURE_MAP = side
    results = {}
    for name in args.configs:
        results[name] = _run_config(name, modules, args, rank, world)
        if rank == 0:
            print(f"done: {name}", file=sys.stderr, flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def report(results: dict, patches: list[str], args) -> str:
    lines = ["Patches to arcface_torch's files (nothing else changed):"]
    lines += [f"- {p}" for p in patches]
    if args.size != 112:
        lines.append(f"- backbones/iresnet.py: IResNet.fc_scale = {(args.size // 16) ** 2} "
                     f"(class attribute; {args.size} x {args.size} images)")
    lines += ["", f"2 gloo CPU ranks, {args.batch} images per rank ({args.size} x {args.size}), "
              f"{args.classes} classes, "
              f"{args.steps} steps, lr {LR} (poly power 1), SGD momentum {MOMENTUM}, "
              f"weight decay {DECAY}, clip {CLIP}; iresnet [1, 1, 1, 1], D = {EMBEDDING}.", "",
              "| configuration | step-1 grad rel. diff backbone / head | max rel. loss diff "
              "| final 1 - cosine backbone / head | vs itself perturbed 5e-7: max rel. loss "
              "diff | 1 - cosine backbone / head |",
              "| --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        g, c, loss = r["grad"]["ours"], r["cosine"], r["losses"]
        lines.append(
            f"| {name} | {g['backbone']:.1e} / {g['head']:.1e} "
            f"| {_max_rel(loss['ours'], loss['theirs']):.2e} "
            f"| {1 - c['ours']['backbone']:.1e} / {1 - c['ours']['head']:.1e} "
            f"| {_max_rel(loss['perturbed'], loss['ours']):.2e} "
            f"| {1 - c['perturbed']['backbone']:.1e} / {1 - c['perturbed']['head']:.1e} |")
    lines += ["", "Per-step relative loss difference (partial-fc vs arcface_torch; partial-fc "
              "vs its perturbed self):"]
    for name, r in results.items():
        loss = r["losses"]
        vs = [abs(a - b) / abs(b) for a, b in zip(loss["ours"], loss["theirs"], strict=True)]
        me = [abs(a - b) / abs(b) for a, b in zip(loss["perturbed"], loss["ours"],
                                                  strict=True)]
        lines.append(f"- {name}: vs arcface_torch " + " ".join(f"{v:.0e}" for v in vs))
        lines.append(f"  {' ' * len(name)}  vs itself      " + " ".join(f"{v:.0e}" for v in me))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--insightface", required=True, type=Path,
                        help="a checkout of deepinsight/insightface")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4, help="images per rank (>= 2: BN)")
    parser.add_argument("--size", type=int, default=112, choices=(16, 32, 48, 64, 112),
                        help="image side; below 112 the last feature map shrinks with it")
    parser.add_argument("--classes", type=int, default=32, help="even: equal shards")
    parser.add_argument("--configs", nargs="+", default=DEFAULT, choices=list(CONFIGS))
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)
    _, patches = load_arcface_torch(args.insightface)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        from socket import socket

        with socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_worker, args=(2, port, args, out), nprocs=2, join=True)
        results = json.loads(Path(out).read_text())
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(report(results, patches, args))
    return 0 if all(math.isfinite(r["cosine"]["ours"]["backbone"]) for r in results.values()) \
        else 1


if __name__ == "__main__":
    sys.exit(main())
