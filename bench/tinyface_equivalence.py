"""Benchmark: TinyFace rank-1/5/20 as AdaFace's ``validation_lq`` scores it, next to ours.

    python bench/tinyface_equivalence.py --adaface DIR   # DIR: a checkout of AdaFace

Fabricates a TinyFace folder from the AT&T/ORL faces, as AdaFace's ``validate_tinyface.py``
reads it: ``<root>/tinyface/Testing_Set`` (the two ``.mat`` lists, ``Probe/``,
``Gallery_Match/``, ``Gallery_Distractor/``) and the aligned twin
``<root>/aligned_pad_0.1_pad_high/``. Identities s1-s20: images 1-4 are probes (80), 5-6 the
matched gallery (40); the 200 images of s21-s40 are the distractors. File names are
``<identity>_<image>.jpg``: AdaFace takes a probe's identity from its file name, ours from
the ``.mat`` ids, which agree here as in the released set.

One seeded, untrained ``iresnet_tiny`` embeds every aligned image once
(``trainer.evaluation.embed_files``: flip sum, unit rows; AdaFace's ``infer`` with
``pre_norm_vector_add`` fuses the same way), in the order AdaFace lists them. The same
features are then scored by:

- AdaFace: ``tinyface_helper.TinyFaceTest(...).test_identification(features, [1, 5, 20])``
  (``DIR_FAR``, closed set) of ``validation_lq/`` at ``ADAFACE_COMMIT``
  (``data_pipeline/tinyface.py``);
- partial-fc: ``partial_fc.eval.ranking.cmc`` with the distractors through the flat
  ``top_k_search``, and ``evaluate_tinyface_dir`` (``--tinyface``'s path, which reads the
  folder itself and embeds again) end to end.

Patched: ``np.object`` is ``object`` (NumPy 2 removed the alias; tinyface_helper.py builds
its path arrays with it). Prints each rank by both (AdaFace's float32 shares as counts of
probes) and the largest difference in probes; exits 1 if they differ.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
from scipy.io import savemat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ is not installed

from data_pipeline.codec import prepare_jpeg  # noqa: E402
from data_pipeline.orl import find_orl_root  # noqa: E402
from data_pipeline.tinyface import ALIGNED_DIR, read_tinyface  # noqa: E402
from partial_fc.backbones import build_backbone  # noqa: E402
from partial_fc.eval.gallery_search import top_k_search  # noqa: E402
from partial_fc.eval.ranking import TINYFACE_RANKS, cmc  # noqa: E402
from tests.eval_helpers import tinyface_cells  # noqa: E402
from trainer.evaluation import embed_files, eval_mode, evaluate_tinyface_dir  # noqa: E402

PROBE_IMAGES, MATCH_IMAGES = range(1, 5), range(5, 7)


def _adaface_helper(adaface: Path) -> types.ModuleType:
    path = adaface / "validation_lq" / "tinyface_helper.py"
    if not path.is_file():
        raise SystemExit(f"{path}: missing (give a checkout of mk-minchul/AdaFace)")
    np.object = object  # NumPy 2 removed the alias tinyface_helper.py uses
    spec = importlib.util.spec_from_file_location("adaface_tinyface_helper", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_orl_tinyface(root: Path) -> None:
    """The released layout and its aligned twin (see the module docstring)."""
    orl = find_orl_root()
    subsets = {"Probe": [(i, k) for i in range(1, 21) for k in PROBE_IMAGES],
               "Gallery_Match": [(i, k) for i in range(1, 21) for k in MATCH_IMAGES],
               "Gallery_Distractor": [(i, k) for i in range(21, 41) for k in range(1, 11)]}
    testing = root / "tinyface" / "Testing_Set"
    for subset, faces in subsets.items():
        for folder in (testing / subset, root / ALIGNED_DIR / subset):
            folder.mkdir(parents=True)
            for i, k in faces:
                (folder / f"{i}_{k}.jpg").write_bytes(
                    prepare_jpeg((orl / f"s{i}" / f"{k}.pgm").read_bytes(), 112))
    for mat, subset, names_key, ids_key in (
            ("probe_img_ID_pairs.mat", "Probe", "probe_set", "probe_ids"),
            ("gallery_match_img_ID_pairs.mat", "Gallery_Match", "gallery_set", "gallery_ids")):
        names = [f"{i}_{k}.jpg" for i, k in subsets[subset]]
        savemat(testing / mat, {names_key: tinyface_cells(names),
                                ids_key: np.array([[i] for i, _ in subsets[subset]])})


def ours_cmc(root: Path, features: dict[str, np.ndarray]) -> dict[str, float | int]:
    """partial-fc's scorer on the shared features (keyed by path)."""
    lists = read_tinyface(root)
    matched = lists.num_matched

    def rows(paths):
        return np.stack([features[str(p)] for p in paths])

    probes, distractors = rows(lists.probe_paths), rows(lists.gallery_paths[matched:])
    search = top_k_search(probes, max(TINYFACE_RANKS))
    search.add(distractors)
    return cmc(probes, lists.probe_ids, rows(lists.gallery_paths[:matched]),
               lists.gallery_ids[:matched], distractor_top=search.scores(),
               distractors=len(distractors))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--adaface", type=Path, required=True, help="a checkout of mk-minchul/AdaFace")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    helper = _adaface_helper(args.adaface)
    torch.manual_seed(args.seed)
    backbone = build_backbone("iresnet_tiny", embedding_size=64).eval()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_orl_tinyface(root)
        test = helper.TinyFaceTest(tinyface_root=str(root), alignment_dir_name=ALIGNED_DIR)
        paths = [Path(p) for p in test.image_paths]
        with eval_mode(backbone):
            features = embed_files(backbone, paths, 64, "cpu", "TinyFace")
        theirs = test.test_identification(features, ranks=list(TINYFACE_RANKS))
        ours = ours_cmc(root, dict(zip(map(str, paths), features, strict=True)))
        end_to_end = evaluate_tinyface_dir(backbone, root, 64, "cpu")
    print("patched: np.object = object (NumPy 2 removed it; tinyface_helper.py uses it)")
    # AdaFace's DIR_FAR returns float32 shares: compared as counts of probes.
    probes = ours["num_probes"]
    print(f"{'rank':>4}  {'AdaFace (%)':>11}  {'ours (%)':>9}  {'difference (probes)':>19}  "
          f"{'ours, end to end (%)':>20}")
    worst = 0
    for k, share in zip(TINYFACE_RANKS, theirs, strict=True):
        a, b = round(float(share) * probes), round(ours[f"rank{k}"] * probes)
        worst = max(worst, abs(b - a))
        print(f"{k:4d}  {100 * a / probes:11.4f}  {100 * b / probes:9.4f}  {b - a:19d}  "
              f"{100 * end_to_end[f'rank{k}']:20.4f}")
    print(f"probes {probes}, gallery {ours['gallery_size']}, end to end read "
          f"{end_to_end['alignment']}; largest difference: {worst} probes")
    sys.exit(1 if worst > 0 else 0)


if __name__ == "__main__":
    main()
