"""Train/test overlap (``offline.overlap``, ``python -m launch.overlap``): identities planted
into a verification set are found, 2 ranks agree with one process, the CLI writes an
exclusion list.

The embedding of the planted-identity test is built, not trained: random Fourier features
(Rahimi & Recht, NIPS 2007: cos(Wx + b)) of an 8x8 colour pooling, whose cosine approximates
a Gaussian kernel on the pooled colours. The synthetic identities are colour
fields (data_pipeline.synthetic), so this embedding reveals identity the way a trained face
model does (same identity: cosine near 1, others near 0), at no training cost; what is tested
is the tool: the centres streamed over the shards, the thresholding, the per-set counts.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from eval_helpers import make_run, write_ijb
from spawn import run_ranks
from torch import nn

from data_pipeline.exclusion import read_exclusions
from data_pipeline.synthetic import SyntheticSource
from data_pipeline.verification_bin import write_bin
from offline.overlap import DEFAULT_THRESHOLD, bin_images, class_centres, set_overlap

PLANTED = (3, 7, 11, 15, 19)  # of the 20 training identities (conftest's synthetic_data)


class ColourFeatures(nn.Module):
    """``cos(pool8(x) W / 4 + b)``, 1024 features, fixed by a seed."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(192, 1024, generator=g) / 4.0, requires_grad=False)
        self.b = nn.Parameter(torch.rand(1024, generator=g) * 2 * torch.pi, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cos(F.adaptive_avg_pool2d(x, 8).flatten(1) @ self.w + self.b)


@functools.cache
def evaluation_images() -> list[bytes]:
    """4 unseen images of each planted identity, then 160 of 40 identities never trained on
    (another seed)."""
    same = SyntheticSource(20, 16, seed=0)  # images 8.. of an identity: not in the shards
    other = SyntheticSource(40, 4, seed=1)
    return [same.read(c * 16 + i)[0] for c in PLANTED for i in range(8, 12)] + \
        [other.read(i)[0] for i in range(160)]


def _overlap(data, images):
    model = ColourFeatures()
    centres, counts = class_centres(model, data, 32, "cpu")
    found = set_overlap("x", bin_images(images, 32), len(images), model, centres,
                        DEFAULT_THRESHOLD, 32, "cpu")
    return centres, counts, found


def test_planted_identities_are_found(synthetic_data):
    images = evaluation_images()
    _, counts, found = _overlap(synthetic_data, images)
    assert counts.tolist() == [8.0] * 20
    hits = len(found.classes & set(PLANTED))
    assert hits / len(PLANTED) >= 0.9 and hits / max(1, len(found.classes)) >= 0.9, found
    assert found.images == 180 and 18 <= found.matched_images <= 22


def _ranks(rank, world, data, images):
    centres, counts, found = _overlap(data, images)
    return centres.clone(), counts.clone(), found


def test_two_ranks_agree_with_one_process(synthetic_data):
    images = evaluation_images()
    centres, counts, found = _overlap(synthetic_data, images)
    for c, n, f in run_ranks(_ranks, world_size=2, args=(synthetic_data, images)):
        torch.testing.assert_close(c, centres)
        assert torch.equal(n, counts) and f == found


def test_cli_writes_an_exclusion_list(synthetic_data, tmp_path, capsys):
    from launch.overlap import main

    run = make_run(tmp_path)
    images = evaluation_images()[:40]  # the planted ones
    write_bin(tmp_path / "lfw.bin", images, [True] * 20)
    out = tmp_path / "overlap.txt"
    assert main(["--checkpoint", str(run), "--data", str(synthetic_data), "--bins",
                 str(tmp_path / "lfw.bin"), "--threshold", "-1", "--out", str(out),
                 "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "lfw  40      40              20" in printed  # threshold -1: everything matches
    listed = read_exclusions(out)
    assert listed.classes == frozenset(range(20)) and not listed.samples
    assert out.read_text().startswith(f"# launch.overlap checkpoint={run} data=")


def test_planted_identities_are_found_in_an_ijb_folder(synthetic_data, tmp_path):
    """IJB faces are aligned from their landmarks first (``write_ijb`` puts the 112x112 face
    at 1.5x scale into a 250x250 crop): the planted identities 3 and 7 are still found."""
    from PIL import Image

    from data_pipeline.codec import decode_image
    from data_pipeline.ijb import read_ijb_meta
    from offline.overlap import ijb_images

    def crop(blob: bytes) -> np.ndarray:
        canvas = np.zeros((250, 250, 3), np.uint8)
        face = Image.fromarray(decode_image(blob)).resize((168, 168), Image.BILINEAR)
        canvas[30:198, 20:188] = np.asarray(face)
        return canvas

    images = evaluation_images()
    blobs = images[0:2] + images[4:6] + images[20:28]  # identities 3 and 7, then 8 others
    faces = [(f"{i}.png", i, i, crop(b), 1.0) for i, b in enumerate(blobs)]
    write_ijb(tmp_path / "IJBC", faces, [(0, 1, 1)])
    meta = read_ijb_meta(tmp_path / "IJBC", "IJBC")
    model = ColourFeatures()
    centres, _ = class_centres(model, synthetic_data, 32, "cpu")
    found = set_overlap("IJBC", ijb_images(meta, 5), len(meta.names), model, centres,
                        DEFAULT_THRESHOLD, 5, "cpu")
    assert found.classes == {3, 7} and found.matched_images == 4 and found.images == 12


def test_cli_calibrates_the_threshold_on_the_bins_impostor_pairs(synthetic_data, tmp_path,
                                                                  capsys):
    """No --threshold: the one chosen is the cosine a share --fmr of the .bin's impostor pairs
    reach under the model, recomputed here pair by pair; the line says so."""
    from data_pipeline.codec import decode_image
    from launch.cli import load_backbone_or_exit
    from launch.overlap import main
    from trainer.evaluation import embed_images, eval_mode

    run = make_run(tmp_path)
    other = evaluation_images()[20:]  # 160 images of 40 identities never trained on
    pairs = [(other[i], other[i + 4 * k]) for k in (1, 2) for i in range(0, 120, 3)]  # 80
    write_bin(tmp_path / "lfw.bin", [x for p in pairs for x in p], [False] * len(pairs))
    out = tmp_path / "overlap.txt"
    assert main(["--checkpoint", str(run), "--data", str(synthetic_data), "--bins",
                 str(tmp_path / "lfw.bin"), "--fmr", "0.05", "--out", str(out),
                 "--device", "cpu"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    model = load_backbone_or_exit(run)
    with eval_mode(model):
        emb = [embed_images(model, np.stack([decode_image(b, 112).transpose(2, 0, 1)
                                             for b in p]), 2, "cpu") for p in pairs]
    cos = np.array([float(e[0] @ e[1]) for e in emb])
    tau = float(line.split()[1].rstrip(":"))
    reached = int((cos >= tau - 1e-4).sum())
    assert 1 <= reached <= 4 and (cos > tau + 1e-4).sum() < reached  # 5% of 80, from above
    assert line.startswith(f"threshold {tau:.4f}: the cosine {reached} of the 80 impostor "
                           "pairs of lfw reach under this model (false-match rate")
    assert "--fmr 0.05" in line
    assert f"threshold={tau:.4g}" in out.read_text().splitlines()[0]
