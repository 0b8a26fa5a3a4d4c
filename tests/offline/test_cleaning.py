"""``python -m launch.clean`` (offline.cleaning): planted label noise is found.

The data: synthetic identities where every tenth image is another identity's image under this
identity's label (``data_pipeline.synthetic.MislabelledSource``: 10% label noise, one per
class).

The run is constructed, not trained (a CPU training to convergence takes minutes): an
iResNet-tiny whose BatchNorm statistics are those of this data (no gradient step), and a
sub-center head whose centres are set as sub-center training leaves them (the paper's Fig. 1):
the class's clean images gather on one centre, at a different index per class, and a noisy
image pulls one of the others to itself. So the noisy image's *nearest* centre is not the
dominant one: a tool that took each sample's nearest centre, or centre 0, lists nothing or the
wrong samples; only the vote over the class's samples finds the dominant centre. The listed
samples must hold the planted ones with precision and recall >= 0.8, two ranks (each
streaming half the shards) must list exactly what one process lists, and the loader given
the list (``data.exclude``) must leave out exactly those samples, counted.

(A trained run: ``python bench/clean_noise.py`` prints the same figures after a real
sub-center training on one CPU rank.)
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from spawn import run_ranks

from data_pipeline import make_loader
from data_pipeline.codec import decode_image
from data_pipeline.exclusion import read_exclusions
from data_pipeline.synthetic import MislabelledSource, SyntheticSource
from data_pipeline.tar_reader import tar_samples
from data_pipeline.writer import write_dataset
from launch.clean import main
from partial_fc.backbones import build_backbone, normalize_images
from trainer.checkpoint.integrity import META, sha256
from trainer.evaluation import embed_images

C, M, K, D = 16, 10, 3, 128
PLANTED = MislabelledSource(C, M, every=10).planted  # one per class; key = f"{i:09d}"


def _stored(data: Path) -> tuple[list[str], torch.Tensor, np.ndarray]:
    keys, labels, images = [], [], []
    for shard in sorted(data.glob("shard-*.tar")):
        for s in tar_samples(shard):
            keys.append(s["__key__"])
            labels.append(int(s["cls"]))
            images.append(decode_image(s["jpg"]).transpose(2, 0, 1))
    return keys, torch.tensor(labels), np.stack(images)


def _write_run(root: Path, data: Path) -> Path:
    keys, labels, images = _stored(data)
    torch.manual_seed(0)
    model = build_backbone("iresnet_tiny", embedding_size=D)
    for bn in (m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)):
        bn.momentum = None  # a cumulative average: the data's own statistics
        bn.reset_running_stats()
    with torch.no_grad():
        model.train()(normalize_images(torch.from_numpy(images)))
    emb = embed_images(model.eval(), images, 64, "cpu")
    noisy = torch.tensor([int(k) in PLANTED for k in keys])
    gen = torch.Generator().manual_seed(1)
    centres = torch.randn(C, K, D, generator=gen)
    for c in range(C):
        dominant = c % K
        centres[c, dominant] = emb[(labels == c) & ~noisy].mean(dim=0)
        centres[c, (dominant + 1) % K] = emb[(labels == c) & noisy][0]  # the noisy one's
    run, folder = root / "run", root / "run" / "checkpoints" / "step-00000100"
    folder.mkdir(parents=True)
    weight = centres.reshape(C * K, D) * 0.05  # norms as trained rows have them
    dcp.save({f"head.weight/rows.0.{C * K}": weight},
             storage_writer=dcp.FileSystemWriter(folder / "state"))
    torch.save(model.state_dict(), folder / "backbone.pt")
    files = {str(p.relative_to(folder)): sha256(p) for p in folder.rglob("*") if p.is_file()}
    (folder / META).write_text(json.dumps({"files": files, "rows": ["head.weight"]}))
    (run / "checkpoints" / "latest").write_text(folder.name + "\n")
    cfg = {"name": "t", "backbone": {"name": "iresnet_tiny", "embedding_size": D},
           "margin": {"type": "arcface", "subcenters": K},
           "data": {"num_classes": C}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    return run


@pytest.fixture(scope="module")
def noisy_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("clean")
    write_dataset(MislabelledSource(C, M, seed=0), root / "data", shuffle_seed=None,
                  samples_per_shard=40)
    return root / "data", _write_run(root, root / "data")


def _planted_keys() -> set[str]:
    return {f"{i:09d}" for i in PLANTED}


@pytest.fixture(scope="module")
def cleaned(noisy_run, tmp_path_factory):
    """launch.clean's list for the noisy run at the default threshold, and what it printed."""
    data, run = noisy_run
    out = tmp_path_factory.mktemp("list") / "noisy.txt"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["--checkpoint", str(run), "--data", str(data), "--out", str(out),
                     "--device", "cpu"]) == 0
    return out, printed.getvalue()


def test_planted_noise_is_found(noisy_run, cleaned, tmp_path):
    data, run = noisy_run
    out, printed = cleaned
    listed = read_exclusions(out)
    assert listed.classes == frozenset()
    got, want = set(listed.samples), _planted_keys()
    hits = len(got & want)
    assert hits / len(got) >= 0.8 and hits / len(want) >= 0.8, (len(got), hits, len(want))
    header = out.read_text().splitlines()[0]
    assert header.startswith("# launch.clean checkpoint=") and "threshold=75 degrees" in header
    assert f"{len(got)} of {C * M} samples" in printed
    assert "dominant-center share 0.9" in printed
    # a stricter threshold lists more, clean samples too: the listing grows as it falls
    strict = tmp_path / "strict.txt"
    assert main(["--checkpoint", str(run), "--data", str(data), "--out", str(strict),
                 "--device", "cpu", "--threshold", "30"]) == 0
    assert read_exclusions(strict).samples > listed.samples


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_loader_leaves_out_exactly_the_listed_samples(noisy_run, cleaned, world_size):
    """``data.exclude`` with launch.clean's list: the listed samples are never read, every
    other one once per epoch (up to the epoch's dropped tail), and they are counted."""
    data, _ = noisy_run
    out, _ = cleaned
    listed = read_exclusions(out).samples
    seen = []
    for rank in range(world_size):
        loader = make_loader(data, batch_size=4, rank=rank, world_size=world_size,
                             num_workers=0, with_keys=True, exclude=out)
        assert loader.num_excluded == len(listed)
        seen += [key for _, _, keys in loader for key in keys]
    assert len(seen) == len(set(seen)) and listed.isdisjoint(seen)
    assert len(seen) >= C * M - len(listed) - world_size * 4  # only the tail is dropped


def _on_ranks(rank: int, world: int, run: str, data: str) -> list[str]:
    from launch.clean import load_subcenter_run
    from offline.cleaning import find_noisy

    backbone, centres, _ = load_subcenter_run(run)
    result = find_noisy(backbone, centres, data, progress=False)
    return sorted(result.noisy), result.samples, result.dominant_share


@pytest.mark.slow
def test_two_ranks_list_what_one_process_lists(noisy_run):
    from launch.clean import load_subcenter_run
    from offline.cleaning import find_noisy

    data, run = noisy_run
    backbone, centres, _ = load_subcenter_run(run)
    one = find_noisy(backbone, centres, data)
    both = run_ranks(_on_ranks, 2, args=(str(run), str(data)))
    for noisy, samples, share in both:
        assert noisy == sorted(one.noisy) and samples == one.samples == C * M
        assert share == pytest.approx(one.dominant_share)


def test_a_run_without_subcenters_is_refused(noisy_run, tmp_path, capsys):
    data, trained = noisy_run
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["margin"]["subcenters"] = 1
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["--checkpoint", str(run), "--data", str(data), "--out",
                 str(tmp_path / "x.txt"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "margin.subcenters=1: no sub-centers to clean with" in err and "\n" not in err
    assert not (tmp_path / "x.txt").exists()


def test_data_of_another_class_count_is_refused(noisy_run, tmp_path, capsys):
    _, run = noisy_run
    other = tmp_path / "other"
    write_dataset(SyntheticSource(C + 1, 2, seed=0), other, samples_per_shard=40)
    assert main(["--checkpoint", str(run), "--data", str(other), "--out",
                 str(tmp_path / "x.txt"), "--device", "cpu"]) == 2
    assert f"{C + 1} classes in manifest.json, the checkpoint's head has {C}" in \
        capsys.readouterr().err


def test_a_folder_at_a_url_lists_what_the_local_folder_lists(noisy_run, cleaned, tmp_path,
                                                             s3_store, capsys):
    from tools.remote_servers import upload

    data, run = noisy_run
    url = upload(data, "s3://bucket/noisy")
    out = tmp_path / "noisy.txt"
    assert main(["--checkpoint", str(run), "--data", url, "--out", str(out),
                 "--device", "cpu"]) == 0
    assert read_exclusions(out).samples == read_exclusions(cleaned[0]).samples
    capsys.readouterr()
    assert main(["--checkpoint", str(run), "--data", "s3://bucket/none", "--out", str(out),
                 "--device", "cpu"]) == 2
    assert capsys.readouterr().err == ("error: s3://bucket/none/manifest.json: not found (404, "
                                       "or no such bucket): check the URL; a converted folder "
                                       "holds manifest.json, its shards and their .idx files\n")
