"""Shared fixtures for the evaluation tests: a fabricated run folder and a small .bin."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image
from scipy.io import savemat
from torch import nn

from data_pipeline.ijb import ARCFACE_REFERENCE
from data_pipeline.verification_bin import write_bin
from partial_fc.backbones import build_backbone
from partial_fc.eval.fairness import RFW_GROUPS
from trainer.checkpoint.integrity import META, sha256


def make_run(root: Path, embedding_size: int = 16, tag: str = "step-00000010",
             seed: int = 0, backbone: str = "iresnet_tiny", depth: int | None = None) -> Path:
    """A run folder in the trainer's layout holding a trained-looking ``backbone`` (a ViT
    with ``depth`` blocks where given): its
    ``backbone.pt`` and a ``meta.json`` listing its SHA-256 (what
    ``trainer.checkpoint.integrity`` checks).
    Called again with another ``tag`` (and ``seed``), it adds a checkpoint that ``latest``
    then names."""
    torch.manual_seed(seed)
    model = build_backbone(backbone, embedding_size=embedding_size, depth=depth)
    with torch.no_grad():  # non-trivial running statistics, so eval mode is really exercised
        model.train()(torch.rand(8, 3, 112, 112) * 2 - 1)
    run, folder = root / "run", root / "run" / "checkpoints" / tag
    folder.mkdir(parents=True)
    cfg = {"name": "t", "backbone": {"name": backbone, "embedding_size": embedding_size,
                                     "dropout": 0.0, "depth": depth}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    torch.save(model.state_dict(), folder / "backbone.pt")
    meta = {"files": {"backbone.pt": sha256(folder / "backbone.pt")}}
    (folder / META).write_text(json.dumps(meta))
    (run / "checkpoints" / "latest").write_text(tag + "\n")
    return run


def jpeg(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def make_color_bin(path: Path, num_pairs: int, seed: int = 0) -> np.ndarray:
    """Pairs of solid-colour 112x112 images: same pairs share a colour, different pairs don't.

    Returns the ``issame`` flags (alternating True/False).
    """
    rng = np.random.default_rng(seed)
    issame = np.arange(num_pairs) % 2 == 0
    images = []
    for same in issame:
        a = rng.integers(0, 256, 3)
        b = a if same else (a + 128) % 256
        for colour in (a, b):
            noise = rng.integers(-3, 4, (112, 112, 3))
            images.append(jpeg(np.clip(colour + noise, 0, 255).astype(np.uint8)))
    write_bin(path, images, issame.tolist())
    return issame


class MeanColour(nn.Module):
    """Embedding = mean colour centred at grey: same-colour images have cosine ~1."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x.mean(dim=(2, 3)) * self.scale


def write_ijb(root, faces, pairs, target="ijbc"):
    """A fabricated IJB folder. faces: (name, template, media, rgb colour or a 250x250x3
    image, detector score); the 5 landmarks place the 112x112 crop at 1.5x scale, (20, 30)."""
    (root / "meta").mkdir(parents=True)
    (root / "loose_crop").mkdir()
    lmk = ARCFACE_REFERENCE * 1.5 + [20.0, 30.0]  # the 112x112 crop lies inside the image
    tid, pts = [], []
    for name, template, media, colour, score in faces:
        image = np.broadcast_to(np.asarray(colour, np.uint8), (250, 250, 3))
        Image.fromarray(np.ascontiguousarray(image)).save(root / "loose_crop" / name)
        tid.append(f"{name} {template} {media}")
        pts.append(" ".join([name, *(f"{v:.4f}" for v in lmk.reshape(-1)), str(score)]))
    (root / "meta" / f"{target}_face_tid_mid.txt").write_text("\n".join(tid) + "\n")
    (root / "meta" / f"{target}_name_5pts_score.txt").write_text("\n".join(pts) + "\n")
    (root / "meta" / f"{target}_template_pair_label.txt").write_text(
        "\n".join(" ".join(map(str, p)) for p in pairs) + "\n")


def tinyface_cells(names):
    """A MATLAB ``N x 1`` cell array of file names, as TinyFace's .mat lists hold them
    (loadmat gives ``[N, 1]`` objects, each a one-string array: AdaFace's
    ``tinyface_helper.py`` reads ``row[0].item()``)."""
    cells = np.empty((len(names), 1), dtype=object)
    cells[:, 0] = list(names)
    return cells


def write_tinyface_lists(root: Path, probes, matched, distractors) -> Path:
    """A fabricated TinyFace ``root/tinyface/Testing_Set`` (returned). probes, matched:
    ``(file name, identity id, image)``; distractors: ``(file name, image)``; an image is an
    RGB colour (a 24x20 image of it) or an ``[H, W, 3]`` uint8 array."""
    t = root / "tinyface" / "Testing_Set"
    for folder, entries in (("Probe", probes), ("Gallery_Match", matched),
                            ("Gallery_Distractor", distractors)):
        (t / folder).mkdir(parents=True, exist_ok=True)
        for name, *_, image in entries:
            array = np.asarray(image, np.uint8)
            if array.ndim == 1:
                array = np.full((24, 20, 3), array, np.uint8)
            Image.fromarray(array).save(t / folder / name)
    savemat(t / "probe_img_ID_pairs.mat", {
        "probe_set": tinyface_cells([n for n, _, _ in probes]),
        "probe_ids": np.array([[i] for _, i, _ in probes])})
    savemat(t / "gallery_match_img_ID_pairs.mat", {
        "gallery_set": tinyface_cells([n for n, _, _ in matched]),
        "gallery_ids": np.array([[i] for _, i, _ in matched])})
    return t


WHITE, YELLOW, RED, CYAN = (255, 255, 255), (255, 255, 0), (255, 0, 0), (0, 255, 255)


def solid_image(path: Path, rgb, height: int = 112, width: int = 112) -> None:
    """One plain-coloured image file (folders made; a JPEG at quality 100)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(np.full((height, width, 3), rgb, np.uint8))
    image.save(path, **({"quality": 100} if path.suffix == ".jpg" else {}))


def _rfw_image(folder, group, identity, number, rgb):
    solid_image(folder / "data" / group / identity / f"{identity}_{number:04d}.jpg", rgb)


def write_rfw(root, weak=None):
    """RFW's test/ folder; 10 pairs per group: 5 impostor pairs (red against cyan, cosine -1
    under MeanColour) and 5 genuine pairs, ``weak[group]`` of them white against yellow
    (cosine 1/3, squared distance 4/3), the rest one colour twice (cosine 1)."""
    weak = weak or {}
    folder = root / "test"
    for group in RFW_GROUPS:
        lines = []
        for k in range(5):
            identity = f"m.{group[:2]}{k}"
            second = YELLOW if k < weak.get(group, 0) else WHITE
            _rfw_image(folder, group, identity, 1, WHITE)
            _rfw_image(folder, group, identity, 12, second)
            lines.append(f"{identity}\t1\t12")
            a, b = f"m.{group[:2]}r{k}", f"m.{group[:2]}c{k}"
            _rfw_image(folder, group, a, 1, RED)
            _rfw_image(folder, group, b, 3, CYAN)
            lines.append(f"{a}\t1\t{b}\t3")
        (folder / "txts" / group).mkdir(parents=True, exist_ok=True)
        (folder / "txts" / group / f"{group}_pairs.txt").write_text("\n".join(lines) + "\n")
    return folder


def write_tinyface(root):
    """Probe 1 white, probe 2 red. Gallery: id 1 white and grey-blue, id 2 (255, 0, 128);
    distractor red. Under MeanColour the red probe's mate scores 2/sqrt(6) < 1 (the
    distractor): rank 2; the white probe's mate is exact: rank 1."""
    return write_tinyface_lists(
        root, probes=[("p1.png", 1, WHITE), ("p2.png", 2, RED)],
        matched=[("g1.png", 1, WHITE), ("g2.png", 1, (0, 0, 255)), ("g3.png", 2, (255, 0, 128))],
        distractors=[("d1.png", RED)])


# Under MeanColour a colour's feature is its (R, G, B) mapped to [-1, 1] and normalised.
PROBES = {"A/a1.png": (255, 255, 255),  # (1, 1, 1)/sqrt3
          "A/a2.png": (255, 255, 128),  # ~(1, 1, 0)/sqrt2
          "A/a3.png": (0, 0, 0),        # noisy: becomes normalise(a1 + a2)
          "B/b1.png": (0, 0, 255),      # (-1, -1, 1)/sqrt3
          "B/b2.png": (0, 255, 255)}    # (-1, 1, 1)/sqrt3
DISTRACTORS = {"0/0/d1.png": (255, 0, 0),    # (1, -1, -1)/sqrt3
               "0/0/d2.png": (250, 255, 255),  # noisy (shows A, ~a1): never searched
               "0/1/d3.png": (0, 255, 5),    # ~(-1, 1, -0.96)
               "0/1/d4.png": (0, 0, 250)}    # ~(-1, -1, 0.96)


def write_megaface(root, noises=True):
    """The testsuite's data/ folder. By hand (scores of unit features):

    - A's pairs: a1.a2 = 0.818, a1.a3' = 0.96, a2.a3' = 0.96, and no distractor scores
      above 0 with a1, a2 or a3' (d2, 0.9997 with a1, is noise-listed): 6 of 6 pairs.
    - B: b1.b2 = 1/3. With d1 alone: b1.d1 = -1/3, b2.d1 = -1, both pairs count. With d1, d3,
      d4: b1.d4 = 0.9997 > 1/3 and b2.d3 = 0.351 > 1/3: neither counts.

    So rank-1 at 2 distractors (d1, d2) is 8/8, at 4 (d1..d4) 6/8.
    """
    data = root / "data"
    for folder, images in (("facescrub_images", PROBES), ("megaface_images", DISTRACTORS)):
        for name, rgb in images.items():
            solid_image(data / folder / name, rgb)
    (data / "facescrub_lst").write_text("\n".join(PROBES) + "\n")
    (data / "megaface_lst").write_text("\n".join(DISTRACTORS) + "\n")
    if noises:
        (data / "facescrub_noises.txt").write_text("# noisy FaceScrub\na3.png\n")
        (data / "megaface_noises.txt").write_text("# noisy MegaFace\nx\t0/0/d2.png\n")
    return data
