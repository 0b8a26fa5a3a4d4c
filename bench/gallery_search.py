"""Benchmark: top-k search of probes against a large synthetic gallery streamed in chunks.

    nice -n 10 python bench/gallery_search.py                          # 1M x 512, flat and IVF
    nice -n 10 python bench/gallery_search.py --gallery 10000 100000 --queries 3530

The gallery is ``G`` random unit rows (seeded normal draws, normalised), generated chunk by
chunk so it is never held whole, as ``launch.evaluate`` embeds MegaFace's distractors. Half of
the ``--queries`` probes are a gallery row plus noise (cosine about 0.9 with it: a planted
neighbour), half are fresh draws. Each (index, G) runs in its own process, so its peak
resident set (``ru_maxrss``) is its own:

- ``flat``: ``partial_fc.eval.gallery_search.FlatTopK`` (exact, what the protocols use);
- ``ivf``: ``IvfTopK`` (IndexIVFFlat, nlist 1024, nprobe 32), its time including training on
  the first chunk and adding every row; recall = share of planted neighbours it returns
  as the top-1 score (random rows have no clusters, IVF's worst case).

Printed per run: search seconds (generation excluded), split into ``add`` (flat: the search
itself, chunk by chunk; IVF: training and adding, a cost paid once whatever the number of
queries) and ``scores`` (IVF: the search), queries per second, peak memory. IVF beats flat
once ``queries > ivf add / (flat seconds per query - ivf scores per query)``.
Prints figures, asserts nothing; not run by the test suite.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np

from partial_fc.eval.gallery_search import INDEXES, top_k_search


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _chunks(gallery: int, dim: int, chunk: int, seed: int):
    for start in range(0, gallery, chunk):
        rng = np.random.default_rng([seed, start])
        yield start, _unit(rng.standard_normal((min(chunk, gallery - start), dim)))


def run_one(index: str, gallery: int, dim: int, queries: int, chunk: int, k: int,
            seed: int) -> dict:
    rng = np.random.default_rng([seed, 1 << 40])
    planted_at = rng.choice(gallery, queries // 2, replace=False)
    probes = np.empty((queries, dim), np.float32)
    probes[queries // 2:] = _unit(rng.standard_normal((queries - queries // 2, dim)))
    noise = _unit(rng.standard_normal((queries // 2, dim)))
    planted_score = np.empty(queries // 2, np.float32)
    # First pass: the planted rows (regenerated, not stored), so the search pass is clean.
    for start, rows in _chunks(gallery, dim, chunk, seed):
        hit = (planted_at >= start) & (planted_at < start + len(rows))
        probes[:queries // 2][hit] = _unit(rows[planted_at[hit] - start] + 0.5 * noise[hit])
    for start, rows in _chunks(gallery, dim, chunk, seed):
        hit = (planted_at >= start) & (planted_at < start + len(rows))
        planted_score[hit] = (probes[:queries // 2][hit] * rows[planted_at[hit] - start]).sum(1)
    search = top_k_search(probes, k, index)
    add_s = 0.0
    for _, rows in _chunks(gallery, dim, chunk, seed):
        begin = time.perf_counter()
        search.add(rows)
        add_s += time.perf_counter() - begin
    begin = time.perf_counter()
    top = search.scores()
    scores_s = time.perf_counter() - begin
    seconds = add_s + scores_s
    recall = float((top[:queries // 2, 0] >= planted_score - 1e-5).mean())
    return {"index": index, "gallery": gallery, "dim": dim, "queries": queries,
            "seconds": seconds, "add_s": add_s, "scores_s": scores_s,
            "queries_per_s": queries / seconds, "planted_recall": recall,
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gallery", type=int, nargs="+", default=[1_000_000])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--chunk", type=int, default=65536)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--index", nargs="+", choices=INDEXES, default=list(INDEXES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child process
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args.index[0], args.gallery[0], args.dim, args.queries,
                                 args.chunk, args.k, args.seed)))
        return
    print(f"{'index':5}  {'gallery':>9}  {'queries':>7}  {'seconds':>8}  {'add':>7}  "
          f"{'scores':>7}  {'queries/s':>9}  {'recall':>6}  {'peak MiB':>8}")
    for gallery in args.gallery:
        for index in args.index:
            out = subprocess.run(
                [sys.executable, __file__, "--one", "--index", index, "--gallery", str(gallery),
                 "--dim", str(args.dim), "--queries", str(args.queries), "--chunk",
                 str(args.chunk), "--k", str(args.k), "--seed", str(args.seed)],
                check=True, capture_output=True, text=True).stdout
            r = json.loads(out.splitlines()[-1])
            print(f"{index:5}  {gallery:>9}  {args.queries:>7}  {r['seconds']:>8.2f}  "
                  f"{r['add_s']:>7.2f}  {r['scores_s']:>7.2f}  "
                  f"{r['queries_per_s']:>9.1f}  {r['planted_recall']:>6.3f}  "
                  f"{r['peak_mib']:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
