"""Benchmark: what a person held as two classes costs a model, and what ``data.merge`` wins back,
beside Partial FC's sampling and the inter-class filter.

    python bench/merge_effect.py [--settings orl synthetic] [--seeds 0 1 2] [--jobs 2]
                                 [--people 2000 --shared 500 --within 40 --test 200 --null 200]
                                 [--noise 80] [--fpir 0.02] [--work DIR] [--out FILE.json]
                                 [key=value ...]

Two training sets that share known people (``bench/merge_sets.py``: ORL's two-set split of
docs/data.md, and synthetic people at scale), trained with the same recipe in each way of
``WAYS``: (a) side by side (``data.dirs``), (b) the same with ``head.sample_rate`` 0.3 and
0.1, (c) with ``margin.interclass_filter=0.4`` (the ORL bench's value), (d) merged with the
finder's list struck of its false pairs by the known truth (as a person reviewing the pairs
would), (e) merged with the true list, (f) set A alone. The finder is (f)'s model of the same
seed (a model that has seen A only): ``python -m launch.overlap --between A,B --within`` with
B's own people it never saw as the null (ORL at ``--fpir 0.2``, docs/data.md's second value:
at 0.1, the least its ten null people resolve, the tool refuses a seed whose two null people
are each other's nearest, their one cosine the highest twice, and says to raise it; synthetic
at ``--fpir``). Every model is scored on people no set holds: all pairs of
the test images (``partial_fc.eval.verification.evaluate_pairs``: TAR at FAR 1e-3 and 1e-4;
"-" where too few impostor pairs resolve it) and rank-1 identification of each person's other
images against a gallery of one image a person (``partial_fc.eval.ranking.cmc``). Prints mean
± std over the seeds, and the finder's own accuracy; ``--out`` writes the rows as JSON and the
tables beside it (``.md``). Runs ``--jobs`` trainings at a time (one CPU thread each).

How the settings were chosen, written before any (a) or (d) row was run, and not changed after:

- ORL: ``configs/orl.yaml`` as it is (the recipe docs/orl_results.md measured), tested on
  s31-s40 as the ORL bench is, over the same three seeds as the synthetic setting (the budget;
  the spread in the table says how stable the mean is).
- Synthetic: the issue's floor of 2,000 people a set, 25 % of them (500) in both, 2 % (40) of
  each set's own people under two names, four images a person (shared people two in each
  set), 200 test people and 200 null people. The recipe is ``configs/orl.yaml``'s (iresnet_tiny,
  the smallest backbone, 128-d, ArcFace m=0.2) with ``margin.s=16`` (above the NormFace bound
  ln((C-1) 9) = 10.5 at C ~ 4,000), batches of 64, one epoch: the CPU budget (under an hour on
  2 cores for the whole bench) sets the schedule, and a short schedule over many people is what
  keeps the task hard. Difficulty: the generator's default noise (sigma 10) was to stay unless a
  pilot of row (e) alone, at a seed not in the table (99), came out above 95 % TAR@FAR=1e-3. It
  came out at 99.1 % (untrained: 36.1 %), so 40, fixed before its own pilot with this rule:
  kept if its pilot (e) at seed 99 lands between 50 % and 95 %, else 80 (above) or 25 (below),
  with no further pilot. It came out at 98.7 %, so ``--noise 80``, not piloted. The FPIR,
  0.02, was chosen so that the expected false pairs (about 80 over ~4,000 searches) are a
  short review beside the 580 true pairs.

Each row is appended to ``WORK/rows.jsonl`` (each finder to ``WORK/finders.jsonl``) as it comes,
so a run cut short keeps what it trained, and a run again in the same ``--work`` reuses each row
whose training (setting, way, seed, overrides) would be the same.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from merge_sets import orl_sets, review, synthetic_sets, write_true_list

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "orl.yaml"
FARS = ("tar@far=1e-03", "tar@far=1e-04")
ORL_FPIR = 0.2
# the synthetic recipe: configs/orl.yaml with these (the module docstring says why)
SYNTHETIC_RECIPE = ("margin.s=16", "train.batch_size=64", "train.epochs=1")
# way -> (which data, overrides)
WAYS: dict[str, tuple[str, tuple[str, ...]]] = {
    "(a) side by side, r=1": ("side", ()),
    "(b) side by side, r=0.3": ("side", ("head.sample_rate=0.3",)),
    "(b) side by side, r=0.1": ("side", ("head.sample_rate=0.1",)),
    "(c) side by side, inter-class filter 0.4": ("side", ("margin.interclass_filter=0.4",)),
    "(d) merged, finder's list reviewed": ("reviewed", ()),
    "(e) merged, true list": ("truth", ()),
    "(f) set A alone": ("one", ()),
}


def score(backbone, images: np.ndarray, ids: np.ndarray) -> dict[str, float | None]:
    """TAR at FARS over all pairs of the images, and rank-1 of every image but each person's
    first against a gallery of the firsts."""
    from partial_fc.eval.ranking import cmc
    from partial_fc.eval.verification import evaluate_pairs, resolves
    from trainer.evaluation import embed_images

    backbone.eval()
    emb = embed_images(backbone, images, 128, "cpu").numpy()
    i, j = np.triu_indices(len(ids), 1)
    pairs = evaluate_pairs(emb[i], emb[j], ids[i] == ids[j])
    first = np.zeros(len(ids), bool)
    first[np.unique(ids, return_index=True)[1]] = True
    rank = cmc(emb[~first], ids[~first], emb[first], ids[first], ranks=(1,))
    return {far: pairs[far] if resolves(pairs["impostor_pairs"], float(far[8:])) else None
            for far in FARS} | {"rank1": rank["rank1"], "auc": pairs["auc"]}


def train_and_score(job: dict) -> dict:
    """One training (``launch.train.main`` in this process) and its scores: a row. torch and
    the trainer are imported here, in the worker, so that ``--help`` needs neither."""
    import torch

    from launch import train
    from trainer.checkpoint.backbone import load_backbone
    from trainer.config import load_config

    torch.set_num_threads(job["threads"])
    os.environ["WANDB_MODE"] = "disabled"
    run = Path(job["run"])
    args = ["--config", str(CONFIG), f"output={run}", f"seed={job['seed']}",
            "log.progress=false", "log.wandb=disabled", "checkpoint.resume=none", *job["args"]]
    start = time.perf_counter()
    if train.main(args, keep_host_heap=True) != 0:  # as `python -m launch.train` runs
        raise RuntimeError(f"{job['way']}: launch.train failed ({' '.join(args)})")
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = max(r["step"] for r in records if "loss" in r)
    classes = load_config(run / "config.yaml", resolve=False).data.num_classes
    backbone, _ = load_backbone(run)
    test = np.load(job["test"])
    row = {k: job[k] for k in ("setting", "way", "seed", "args")}
    return row | {"classes": classes, "steps": steps, "train_s": round(wall, 1)} | score(
        backbone, test["images"], test["ids"])


def find_pairs(sets, finder: Path, fpir: float, out: Path) -> dict:
    """``launch.overlap --between A,B --within`` with the finder, then the review: its counts."""
    found = out.with_suffix(".found.txt")
    command = [sys.executable, "-m", "launch.overlap", "--checkpoint", str(finder),
               "--between", f"{sets.a},{sets.b}", "--within", "--fpir", str(fpir),
               "--held-out", f",{sets.null}", "--out", str(found), "--json",
               str(found.with_suffix(".json")), "--device", "cpu"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise RuntimeError(f"launch.overlap failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    report = json.loads(found.with_suffix(".json").read_text())
    return {"fpir": fpir, "threshold": report["threshold"],
            "expected_false": report["expected_false"]} | review(found, out, sets.truth)


def _reviewed(work: Path, setting: str, fpir: float, seed: int) -> Path:
    """Where (d)'s list goes: named by the FPIR, so a row of another FPIR is not reused."""
    return work / f"{setting}_reviewed-fpir{fpir:g}-seed{seed}.txt"


def _jobs(setting: str, sets, seeds, work: Path, common: list[str], threads: int,
          fpir: float):
    """Every training of a setting but (d), whose list waits for the finder (f)."""
    from data_pipeline.manifest import read_manifest

    recipe = list(SYNTHETIC_RECIPE) if setting == "synthetic" else []
    samples = {folder: read_manifest(folder).num_samples for folder in (sets.a, sets.b)}
    truth = work / f"{setting}_truth.txt"
    write_true_list(truth, sets)
    data = {"side": [f"data.dirs=[{sets.a},{sets.b}]"], "one": [f"data.dir={sets.a}"],
            "truth": [f"data.dirs=[{sets.a},{sets.b}]", f"data.merge={truth}"]}
    jobs = {}
    for seed in seeds:
        for index, (way, (kind, extra)) in enumerate(WAYS.items()):
            data["reviewed"] = [f"data.dirs=[{sets.a},{sets.b}]",
                                f"data.merge={_reviewed(work, setting, fpir, seed)}"]
            jobs[(setting, way, seed)] = {
                "setting": setting, "way": way, "seed": seed, "threads": threads,
                "run": str(work / "runs" / f"{setting}-{index}{way[1]}-seed{seed}"),
                "test": str(work / f"{setting}_test.npz"),
                "args": [*data[kind], *recipe, *extra, *common],
                "images": samples[sets.a] + (0 if kind == "one" else samples[sets.b])}
    return jobs


def _key(job_or_row: dict) -> tuple:
    return tuple(job_or_row[k] for k in ("setting", "way", "seed")) + tuple(job_or_row["args"])


def run_all(args, work: Path) -> tuple[list[dict], list[dict]]:
    """Train and score every (setting, way, seed), --jobs at a time; the finder after (f)."""
    jobs, sets, fpir = {}, {}, {}
    for setting in args.settings:
        if setting == "orl":
            sets[setting] = orl_sets(work)
        else:
            sets[setting] = synthetic_sets(work, args.people, args.shared, args.within,
                                           args.test, args.null, args.noise)
        np.savez(work / f"{setting}_test.npz", images=sets[setting].test_images,
                 ids=sets[setting].test_ids)
        fpir[setting] = ORL_FPIR if setting == "orl" else args.fpir
        jobs |= _jobs(setting, sets[setting], args.seeds, work, args.overrides, args.threads,
                      fpir[setting])
    waiting = {key: job for key, job in jobs.items() if key[1].startswith("(d)")}
    queue = [job for key, job in jobs.items() if key not in waiting]
    # the finders first, then the longest trainings first (an epoch's images): short ones
    # fill the last minutes, where the longest last would leave --jobs - 1 cores idle
    queue.sort(key=lambda job: (not job["way"].startswith("(f)"), -job["images"]))
    rows, finders, log = [], [], work / "rows.jsonl"
    # rows a cut run left in WORK, reused where the same training would run again
    earlier = {_key(row): row for row in map(json.loads, log.read_text().splitlines())
               } if log.is_file() else {}
    pool = (ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn"))
            if args.jobs > 1 else None)
    running = set()
    try:
        while queue or running:
            while queue and (pool is None or len(running) < args.jobs):
                job = queue.pop(0)
                row = earlier.get(_key(job))
                if row is None and pool is not None:
                    running.add(pool.submit(train_and_score, job))
                else:  # reused, or --jobs 1 (in this process): a finished future
                    running.add(future := Future())
                    future.set_result(row or train_and_score(job))
                    future.reused = row is not None
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                row = future.result()
                rows.append(row)
                if not getattr(future, "reused", False):
                    with open(log, "a") as f:
                        f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
                if row["way"].startswith("(f)"):
                    setting, seed = row["setting"], row["seed"]
                    reviewed = _reviewed(work, setting, fpir[setting], seed)
                    found = find_pairs(sets[setting], Path(jobs[(setting, row["way"], seed)]
                                                          ["run"]), fpir[setting], reviewed)
                    finders.append({"setting": setting, "seed": seed} | found)
                    with open(work / "finders.jsonl", "a") as f:
                        f.write(json.dumps(finders[-1]) + "\n")
                    print(json.dumps(finders[-1]), flush=True)
                    queue.insert(0, waiting[(setting, "(d) merged, finder's list reviewed",
                                             seed)])
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    order = {key: i for i, key in enumerate(jobs)}
    return sorted(rows, key=lambda r: order[(r["setting"], r["way"], r["seed"])]), finders


def _spread(values: list) -> str:
    if any(v is None for v in values):
        return "-"
    mean = 100 * statistics.mean(values)
    return f"{mean:.1f}" + (f" ± {100 * statistics.stdev(values):.1f}" if len(values) > 1 else "")


def tables(rows: list[dict], finders: list[dict]) -> str:
    """The markdown tables: each way's figures (mean ± std over seeds), then the finder's."""
    lines = ["| setting | way | classes | TAR@FAR=1e-3 (%) | TAR@FAR=1e-4 (%) | rank-1 (%) "
             "| seeds |", "|---|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["setting"], r["way"]) for r in rows):
        mine = [r for r in rows if (r["setting"], r["way"]) == key]
        classes = sorted({r["classes"] for r in mine})
        lines.append(f"| {key[0]} | {key[1]} | {'/'.join(map(str, classes))} | "
                     + " | ".join(_spread([r[k] for r in mine]) for k in (*FARS, "rank1"))
                     + f" | {', '.join(str(r['seed']) for r in mine)} |")
    lines += ["", "| setting | seed | FPIR | τ | pairs listed | shared people listed (of) "
              "| within-set listed (of) | false pairs | expected false (≤) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for f in finders:
        lines.append(f"| {f['setting']} | {f['seed']} | {f['fpir']:g} | {f['threshold']:.3f} "
                     f"| {f['listed']} | {f['true_across']} ({f['there_across']}) "
                     f"| {f['true_within']} ({f['there_within']}) | {f['false']} "
                     f"| {f['expected_false']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/merge_effect.py", description=__doc__.split("\n")[0])
    p.add_argument("--settings", nargs="+", choices=("orl", "synthetic"),
                   default=["orl", "synthetic"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--people", type=int, default=2000, help="synthetic: people a set")
    p.add_argument("--shared", type=int, default=500, help="synthetic: people in both sets")
    p.add_argument("--within", type=int, default=40,
                   help="synthetic: each set's own people held under two names")
    p.add_argument("--test", type=int, default=200, help="synthetic: test people")
    p.add_argument("--null", type=int, default=200, help="synthetic: B's people the null")
    p.add_argument("--noise", type=float, default=80.0,
                   help="synthetic: the pixel noise's sigma (the generator's default is 10)")
    p.add_argument("--fpir", type=float, default=0.02, help="synthetic: the finder's FPIR")
    p.add_argument("--jobs", type=int, default=2, help="trainings at a time (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads a training")
    p.add_argument("--work", type=Path, help="data + runs (default: a temporary folder)")
    p.add_argument("--out", type=Path, help="write the rows here (JSON) and the tables (.md)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every run")
    args = p.parse_args(argv)
    os.environ["WANDB_MODE"] = "disabled"
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        rows, finders = run_all(args, work)
        minutes = (time.perf_counter() - start) / 60
    table = tables(rows, finders)
    command = "python bench/merge_effect.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"\n{command}  ({minutes:.0f} min)\n\n{table}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": command, "minutes": round(minutes, 1),
                                        "rows": rows, "finders": finders}, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(f"`{command}` ({minutes:.0f} min)\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
