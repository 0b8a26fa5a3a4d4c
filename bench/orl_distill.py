"""Benchmark: does a teacher's embedding make a small student verify better? ORL and synthetic.

    .venv/bin/python bench/orl_distill.py [--set orl|synthetic] [--seeds 1 2 3] [--work DIR]
                                          [--teacher-epochs N] [--student-epochs N]

One teacher is trained (seed 0) and embedded once (``python -m launch.embed``'s
``offline.embedding_sets.embed_shards``, with the mirrored views); then, for each seed, the
student is trained alone and with ``distill.embeddings`` (``DISTILL``), everything else equal
(``launch.train.main`` in this process, one CPU thread). Each network is scored on
identities it never saw, embedded once with the evaluator's flip TTA:

- ``orl``: ``make train-orl``'s split. Teacher ``iresnet18``, student ``mbf``
  (MobileFaceNet), both 128-d, ``configs/orl.yaml`` otherwise; the s31-s40 pairs of
  ``orl.bin`` (450 genuine, 450 impostor: 10-fold accuracy and AUC), TAR@FAR=1e-3 on all
  4 950 pairs of those 100 images.
- ``synthetic``: ``data_pipeline.synthetic``'s identities, ``TRAIN_CLASSES`` x ``IMAGES``
  to train on, the next ``TEST_CLASSES`` held out (every genuine pair and as many seeded
  impostor pairs for accuracy and AUC, all pairs for TAR@FAR). Teacher and student are both
  ``iresnet_tiny`` (an r18 teacher costs ~20 s a step on this CPU): the teacher trains
  ``--teacher-epochs``, the student the shorter ``--student-epochs``, so what the teacher
  can give is what more training learnt, not more capacity.

Prints markdown tables (per seed and mean ± std over seeds); asserts nothing; not part of
the tests. ``make bench-distill`` runs both sets with the sizes of docs/orl_results.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np
import torch
from orl_margins import CONFIG, FAR, TEST_IDS, all_pairs_images, open_set_data

from data_pipeline import write_synthetic_dataset
from data_pipeline.codec import decode_image, resolve_decoder
from data_pipeline.orl_pairs import orl_pairs
from data_pipeline.synthetic import SyntheticSource
from launch import train
from offline.embedding_sets import embed_shards
from partial_fc.backbones import build_backbone
from partial_fc.eval.verification import evaluate_pairs
from trainer.checkpoint.backbone import load_backbone
from trainer.config import load_config
from trainer.evaluation import embed_images

TRAIN_CLASSES, TEST_CLASSES, IMAGES = 100, 40, 8
DISTILL = ("distill.loss=cosine", "distill.weight=5.0", "distill.head_init=true")
SETS = {  # set -> (teacher overrides, student overrides, default teacher/student epochs)
    "orl": (("backbone.name=iresnet18",), ("backbone.name=mbf",), 2, 1),
    "synthetic": ((), (), 6, 1),
}


def synthetic_data(work: Path):
    """Training shards of ``TRAIN_CLASSES`` identities, and the held-out images (uint8
    ``[TEST_CLASSES * IMAGES, 3, 112, 112]``) with their balanced and all pairs."""
    shards = work / "synthetic"
    if not (shards / "manifest.json").is_file():
        write_synthetic_dataset(shards, TRAIN_CLASSES, IMAGES)
    source, decoder = SyntheticSource(TRAIN_CLASSES + TEST_CLASSES, IMAGES), resolve_decoder("auto")
    first = TRAIN_CLASSES * IMAGES
    images = np.stack([decode_image(source.read(first + i)[0], 112, decoder).transpose(2, 0, 1)
                       for i in range(TEST_CLASSES * IMAGES)])
    every = [(a, b, a // IMAGES == b // IMAGES)
             for a, b in itertools.combinations(range(len(images)), 2)]
    genuine = [p for p in every if p[2]]
    impostor = [p for p in every if not p[2]]
    rng = np.random.default_rng(0)
    chosen = [impostor[j] for j in np.sort(rng.choice(len(impostor), len(genuine), False))]
    return shards, images, genuine + chosen, every


def orl_data(work: Path):
    """``make train-orl``'s shards, the 100 s31-s40 images, ``orl.bin``'s pairs and all pairs."""
    shards, _ = open_set_data(work)
    images, faces, every = all_pairs_images()
    index = {face: n for n, face in enumerate(faces)}
    balanced = [(index[a], index[b], same) for a, b, same in orl_pairs(TEST_IDS, 450)]
    return shards, images, balanced, every


def score(backbone, images: np.ndarray, balanced: list, every: list) -> dict[str, float]:
    """Accuracy (± fold std) and AUC on ``balanced``, TAR@FAR=1e-3 on ``every`` pair."""
    emb = embed_images(backbone.eval(), images, 64, "cpu").numpy()

    def pairs(which):
        a, b, same = (np.array(column) for column in zip(*which, strict=True))
        return evaluate_pairs(emb[a], emb[b], same.astype(bool))

    result = pairs(balanced)
    return {"accuracy": result["accuracy"], "accuracy_std": result["accuracy_std"],
            "auc": result["auc"], FAR: pairs(every)[FAR]}


def trained(run: Path, shards: Path, seed: int, epochs: int, overrides) -> dict:
    """Train ``configs/orl.yaml`` + ``overrides`` into ``run``; the last logged step's loss
    and distillation cosine, and the wall time."""
    start = time.perf_counter()
    args = [f"data.dir={shards}", f"output={run}", f"seed={seed}", f"train.epochs={epochs}",
            "log.progress=false", "checkpoint.resume=none", "backbone.embedding_size=128",
            *overrides]
    if train.main(["--config", str(CONFIG), *args]) != 0:
        raise RuntimeError(f"launch.train failed: {args}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]
    return {"loss": last["loss"], "cosine": last.get("distill_cos_mean"),
            "steps": last["step"], "wall": time.perf_counter() - start}


def untrained(seed: int, overrides) -> torch.nn.Module:
    """The student exactly as ``launch.train`` initialises it (``torch.manual_seed(seed)``)."""
    cfg = load_config(CONFIG, ["backbone.embedding_size=128", *overrides], resolve=False)
    torch.manual_seed(seed)
    return build_backbone(**cfg.backbone.build_kwargs())


def _pct(values: list[float]) -> str:
    if len(values) == 1:
        return f"{100 * values[0]:.2f}"
    return f"{100 * statistics.mean(values):.2f} ± {100 * statistics.stdev(values):.2f}"


def summary(rows: list[dict], seeds: list[int]) -> str:
    lines = ["| model | " + " | ".join(f"seed {s}" for s in seeds) + " | accuracy (%) | AUC "
             "| TAR@FAR=1e-3 (%) | student-teacher cosine at the end | steps |",
             "|" + "---|" * (len(seeds) + 6)]
    for name in dict.fromkeys(r["name"] for r in rows):
        mine = [r for r in rows if r["name"] == name]
        auc = [r["auc"] for r in mine]
        auc_text = (f"{auc[0]:.4f}" if len(auc) == 1 else
                    f"{statistics.mean(auc):.4f} ± {statistics.stdev(auc):.4f}")
        cos = [r["cosine"] for r in mine if r["cosine"] is not None]
        lines.append(f"| {name} | " + " | ".join(f"{100 * r['accuracy']:.2f}" for r in mine)
                     + " |" * (len(seeds) - len(mine)) + f" | {_pct([r['accuracy'] for r in mine])}"
                     f" | {auc_text} | {_pct([r[FAR] for r in mine])} | "
                     + (f"{min(cos):.2f}-{max(cos):.2f}" if cos else "-")
                     + f" | {mine[0]['steps']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", choices=list(SETS), default="orl")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--work", type=Path, help="data + run folders, kept (default: a temporary "
                   "one)")
    p.add_argument("--teacher-epochs", type=int)
    p.add_argument("--student-epochs", type=int)
    args = p.parse_args(argv)
    teacher_overrides, student_overrides, teacher_epochs, student_epochs = SETS[args.set]
    teacher_epochs = args.teacher_epochs or teacher_epochs
    student_epochs = args.student_epochs or student_epochs
    torch.set_num_threads(1)
    os.environ["WANDB_MODE"] = "disabled"
    with TemporaryDirectory() as tmp:
        work = (args.work or Path(tmp)) / args.set
        work.mkdir(parents=True, exist_ok=True)
        shards, images, balanced, every = (orl_data if args.set == "orl" else synthetic_data)(work)
        runs, rows = work / "runs", []

        def add(name: str, run: Path | None, seed: int, out: dict) -> None:
            backbone = load_backbone(run)[0] if run else untrained(seed, student_overrides)
            rows.append({"name": name, "seed": seed, **out,
                         **score(backbone, images, balanced, every)})
            r = rows[-1]
            print(f"{name} seed {seed}: accuracy {r['accuracy']:.4f} AUC {r['auc']:.4f} "
                  f"TAR@FAR=1e-3 {r[FAR]:.4f} loss {r['loss']:.3f} {r['wall']:.0f} s", flush=True)

        teacher = runs / "teacher"
        add("teacher", teacher, 0, trained(teacher, shards, 0, teacher_epochs, teacher_overrides))
        stored = work / "teacher_embeddings"
        start = time.perf_counter()
        embed_shards(load_backbone(teacher)[0], str(teacher), shards, stored, flip=True)
        print(f"teacher embeddings: {time.perf_counter() - start:.0f} s", flush=True)
        for seed in args.seeds:
            add("student untrained", None, seed,
                {"loss": float("nan"), "cosine": None, "steps": 0, "wall": 0.0})
            alone = runs / f"alone-seed{seed}"
            add("student alone", alone, seed,
                trained(alone, shards, seed, student_epochs, student_overrides))
            distilled = runs / f"distilled-seed{seed}"
            add("student distilled", distilled, seed,
                trained(distilled, shards, seed, student_epochs,
                        (*student_overrides, f"distill.embeddings={stored}", *DISTILL)))
        print(f"\n{args.set}: teacher {' '.join(teacher_overrides) or 'iresnet_tiny'}, "
              f"{teacher_epochs} epochs; student {' '.join(student_overrides) or 'iresnet_tiny'},"
              f" {student_epochs} epochs; distilled: {' '.join(DISTILL)}\n")
        print(summary(rows, args.seeds))


if __name__ == "__main__":
    main()
