"""Benchmark: MegaFace rank-1 as FaceX-Zoo's Python devkit twin scores it, next to ours.

    python bench/megaface_equivalence.py --facex DIR   # DIR: a checkout of FaceX-Zoo

Fabricates insightface's MegaFace testsuite ``data/`` folder from the AT&T/ORL faces: FaceScrub
is s1-s10 (10 images each, so 900 ordered mate/probe pairs), the distractors are the 300
images of s11-s40 under ``<a>/<b>/``; two FaceScrub images and six distractors are listed as
noise. One seeded, untrained ``iresnet_tiny`` (512-d, FaceX-Zoo's ``feature_dim``) embeds every
image once (``trainer.evaluation.embed_files``: flip sum, unit rows); the same features are
then scored at 10, 30, 100 and 300 distractors by:

- FaceX-Zoo: ``CommonMegaFaceEvaluator.get_rankN_accuracy(1)`` of
  ``test_protocol/megaface/megaface_evaluator.py`` at ``FACEX_ZOO_COMMIT``
  (``partial_fc/eval/megaface.py``), reading the features as the ``.npy`` files and JSON lists
  it reads, cleaned by its own ``test_protocol/remove_noises.py``: a noisy FaceScrub image
  becomes its identity's normalised centre (as insightface's and ours), a noisy distractor a
  zero vector. insightface's rule, which ours follows, puts a noisy distractor past every
  probe (a 513th dimension of 100) so that it never outranks a mate; the column "FaceX-Zoo,
  noise left out" feeds the evaluator that rule's equivalent, the list without the noisy
  distractors (the first ``n`` of ``megaface_lst`` less those listed as noise).
- partial-fc: ``clean_probe_features``, the flat ``top_k_search`` and
  ``megaface_identification`` on the same features, and ``evaluate_megaface_dir`` (``--megaface``'s
  path, which embeds the files again) end to end.

Patched: ``prettytable`` (imported by the evaluator module, used only by ``test_cmc``, which
is not called) is a stand-in module. Prints each size's rank-1 (%) by each and the largest
difference; exits 1 if ours differs from FaceX-Zoo's evaluator on the rule ours follows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

from data_pipeline.codec import prepare_jpeg
from data_pipeline.megaface import read_megaface
from data_pipeline.orl import find_orl_root
from partial_fc.backbones import build_backbone
from partial_fc.eval.gallery_search import top_k_search
from partial_fc.eval.megaface import clean_probe_features, megaface_identification
from trainer.evaluation import embed_files, eval_mode, evaluate_megaface_dir

SIZES = (10, 30, 100, 300)
PROBE_NOISE = ("s1_3.jpg", "s7_10.jpg")
DISTRACTOR_NOISE = (0, 1, 25, 60, 150, 299)  # indices into megaface_lst


def _facex_module(facex: Path, relative: str, name: str) -> types.ModuleType:
    path = facex / relative
    if not path.is_file():
        raise SystemExit(f"{path}: missing (give a checkout of JDAI-CV/FaceX-Zoo)")
    stub = types.ModuleType("prettytable")
    stub.PrettyTable = object
    sys.modules.setdefault("prettytable", stub)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_orl_megaface(root: Path) -> Path:
    """The testsuite's ``data/`` folder (see the module docstring)."""
    orl, data = find_orl_root(), root / "data"
    probes, distractors = [], []
    for i in range(1, 41):
        for k in range(1, 11):
            name = (f"s{i}/s{i}_{k}.jpg" if i <= 10 else f"{i // 10}/s{i}/s{i}_{k}.jpg")
            path = data / ("facescrub_images" if i <= 10 else "megaface_images") / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(prepare_jpeg((orl / f"s{i}" / f"{k}.pgm").read_bytes(), 112))
            (probes if i <= 10 else distractors).append(name)
    (data / "facescrub_lst").write_text("\n".join(probes) + "\n")
    (data / "megaface_lst").write_text("\n".join(distractors) + "\n")
    (data / "facescrub_noises.txt").write_text("# noisy FaceScrub\n" + "\n".join(PROBE_NOISE)
                                               + "\n")
    (data / "megaface_noises.txt").write_text(
        "# noisy MegaFace\n" + "\n".join(f"x\t{distractors[i]}" for i in DISTRACTOR_NOISE) + "\n")
    return data


def _save_features(folder: Path, names: list[str], feats: np.ndarray) -> None:
    for name, feat in zip(names, feats, strict=True):
        path = folder / name.replace(".jpg", ".npy")
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, feat)


def facex_rank1(facex: Path, data: Path, work: Path, probe_feats: np.ndarray,
                distractor_feats: np.ndarray) -> dict[str, dict[int, float]]:
    """FaceX-Zoo's rank-1 per size: ``{"zero": its noise rule, "left_out": insightface's}``."""
    evaluator = _facex_module(facex, "test_protocol/megaface/megaface_evaluator.py",
                              "facex_megaface_evaluator")
    noises = _facex_module(facex, "test_protocol/remove_noises.py", "facex_remove_noises")
    probes = (data / "facescrub_lst").read_text().split()
    distractors = (data / "megaface_lst").read_text().split()
    _save_features(work / "raw_facescrub", probes, probe_feats)
    _save_features(work / "raw_megaface", distractors, distractor_feats)
    noises.remove_facescrub_noises(str(data / "facescrub_noises.txt"),
                                   str(work / "raw_facescrub"), str(work / "facescrub"))
    noises.remove_megaface_noises(str(data / "megaface_noises.txt"),
                                  str(work / "raw_megaface"), str(work / "megaface"))
    facescrub_json = work / "facescrub.json"
    facescrub_json.write_text(json.dumps({"path": probes,
                                          "id": [p.split("/")[0] for p in probes]}))
    noisy = set(np.array(distractors)[list(DISTRACTOR_NOISE)])
    out: dict[str, dict[int, float]] = {"zero": {}, "left_out": {}}
    for n in SIZES:
        for rule, paths in (("zero", distractors[:n]),
                            ("left_out", [p for p in distractors[:n] if p not in noisy])):
            megaface_json = work / f"megaface_{rule}_{n}.json"
            megaface_json.write_text(json.dumps({"path": paths}))
            scorer = evaluator.CommonMegaFaceEvaluator(
                str(facescrub_json), str(megaface_json), str(work / "facescrub"),
                str(work / "megaface"), False)
            out[rule][n] = scorer.get_rankN_accuracy(1)
    return out


def ours_rank1(probe_feats: np.ndarray, distractor_feats: np.ndarray,
               data: Path) -> dict[int, float]:
    """partial-fc's scorer on the shared features, per size."""
    lists = read_megaface(data)
    feats = clean_probe_features(probe_feats, lists.probe_identities, lists.probe_noisy)
    out = {}
    for n in SIZES:
        search = top_k_search(feats, 1)
        search.add(distractor_feats[:n][~lists.distractor_noisy[:n]])
        out[n] = megaface_identification(feats, lists.probe_identities,
                                         search.scores())["rank1"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--facex", type=Path, required=True, help="a checkout of JDAI-CV/FaceX-Zoo")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    backbone = build_backbone("iresnet_tiny", embedding_size=512).eval()
    with tempfile.TemporaryDirectory() as tmp:
        data = write_orl_megaface(Path(tmp))
        lists = read_megaface(data)
        with eval_mode(backbone):
            probe_feats = embed_files(backbone, lists.probe_paths, 64, "cpu", "FaceScrub")
            distractor_feats = embed_files(backbone, lists.distractor_paths, 64, "cpu",
                                           "MegaFace")
        theirs = facex_rank1(args.facex, data, Path(tmp), probe_feats, distractor_feats)
        ours = ours_rank1(probe_feats, distractor_feats, data)
        end_to_end = evaluate_megaface_dir(backbone, data, 64, "cpu", sizes=SIZES)
    print("patched: prettytable (imported by megaface_evaluator.py, unused here) is a stand-in")
    print(f"{'distractors':>11}  {'FaceX-Zoo, noise left out':>25}  {'ours':>8}  "
          f"{'difference':>10}  {'ours, end to end':>16}  {'FaceX-Zoo, noise as zeros':>25}")
    worst = 0.0
    for n in SIZES:
        a, b = 100 * theirs["left_out"][n], 100 * ours[n]
        worst = max(worst, abs(b - a))
        print(f"{n:11d}  {a:25.4f}  {b:8.4f}  {b - a:10.2e}  "
              f"{100 * end_to_end[f'MegaFace@{n}']['rank1']:16.4f}  "
              f"{100 * theirs['zero'][n]:25.4f}")
    print(f"largest difference against FaceX-Zoo's evaluator (noise left out): {worst:.2e} points")
    sys.exit(1 if worst > 0 else 0)


if __name__ == "__main__":
    main()
