"""The small data the docs' placeholders stand for, built on first use, the way the tests build
theirs: synthetic shards, a run trained here for a few steps, ORL verification pairs,
fabricated IJB, MegaFace and TinyFace folders, RFW in both its forms, an insightface ``.rec``
folder, and an arcface_torch config and output folder in ``train_v2.py``'s format."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

# The docs' placeholders, in every doc: "fixture" or "fixture/part".
PLACEHOLDERS = {
    "/data/faces_emore": "faces_emore",
    "/data/ms1mv3": "shards", "/shared/ms1mv3": "shards", "data/glint360k": "small_shards",
    "data/wf42m": "small_shards", "data/my_faces": "other_shards",
    "runs/ms1mv2_r50": "run", "runs/glint360k_r100_subcenter": "subcenter_run",
    "lfw.bin": "bins/lfw.bin", "cfp_fp.bin": "bins/cfp_fp.bin",
    "agedb_30.bin": "bins/agedb_30.bin", "/data/lfw.bin": "bins/lfw.bin",
    "/data/cfp_fp.bin": "bins/cfp_fp.bin", "/data/agedb_30.bin": "bins/agedb_30.bin",
    "data/lfw.bin": "bins/lfw.bin", "/data/IJB_release": "ijb",
    "/data/megaface_testpack/data": "megaface/data", "/data/tinyface": "tinyface",
    "/data/RFW": "rfw",
    "insightface/recognition/arcface_torch/configs/wf42m_pfc02_r100.py":
        "arcface_configs/wf42m_pfc02_r100.py",
    "insightface/.../wf42m_pfc02_r100.py": "arcface_configs/wf42m_pfc02_r100.py",
    "work_dirs/wf42m_pfc02_r100": "arcface_run", "work_dirs/ms1mv3_r50": "arcface_model",
    # the launch's shape in a multi-node command (run with --check)
    "NODE_RANK=i": "=NODE_RANK=0", "--node_rank i": "=--node_rank 0", "--nnodes N": "=--nnodes 2",
    "<node 0>": "=127.0.0.1",
}
# The placeholders of the commands the programs print for the user to type next.
PRINTED_PLACEHOLDERS = {"YOUR_SHARDS": "small_shards", "OUT": "=data/converted",
                        "/train_tmp/WebFace42M": "faces_emore"}
# Where one doc's name means a run to read and another's a folder a command writes.
DOC_PLACEHOLDERS = {
    "docs/data.md": {"runs/ms1mv3_r50": "run"},
    "docs/evaluation.md": {"runs/orl": "run", "data/orl_s31-s40.bin": "bins/lfw.bin"},
    "docs/training.md": {"runs/ms1mv3_r100": "run", "data/ms1mv3": "shards"},
}

SMALL_CLASSES = 23  # = the arcface_torch output folder's class count (its head's rows)
EMBEDDING = 16


def _synthetic(classes: int, images: int) -> Callable[[Path, Fixtures], None]:
    def build(dest: Path, _fx: Fixtures) -> None:
        from data_pipeline import write_synthetic_dataset
        write_synthetic_dataset(dest, classes, images, seed=0)
    return build


def _trained(*overrides: str) -> Callable[[Path, Fixtures], None]:
    """A run of configs/smoke.yaml, 3 steps on the small shards (launch.train, as a user runs)."""
    def build(dest: Path, fx: Fixtures) -> None:
        fx.python("-m", "launch.train", "--config", "configs/smoke.yaml",
                  f"data.dir={fx.path('small_shards')}", f"output={dest}",
                  "train.max_steps=3", "train.batch_size=8", "log.wandb=disabled", *overrides)
    return build


def _bins(dest: Path, _fx: Fixtures) -> None:
    """ORL's s31-s35 pairs (450) under the names of the sets the docs evaluate on."""
    from data_pipeline.orl_pairs import write_orl_verification_bin
    dest.mkdir(parents=True)
    first = write_orl_verification_bin(dest / "lfw.bin", range(31, 36), num_impostor_pairs=225)
    for name in ("cfp_fp.bin", "agedb_30.bin"):
        shutil.copy(first, dest / name)


def _ijb(dest: Path, _fx: Fixtures) -> None:
    """An IJB_release folder: IJBB and IJBC, 4 templates of 5 plain-coloured faces each, and
    their 1:N gallery and probe lists."""
    from tests.eval_helpers import write_ijb
    white, red = (255, 255, 255), (255, 0, 0)
    faces = [("1.png", 1, 1, white, 1.0), ("2.png", 2, 2, white, 0.9), ("3.png", 3, 3, red, 0.8),
             ("4.png", 4, 4, red, 1.0), ("5.png", 4, 5, white, 0.5)]
    for target, galleries in (("IJBB", ("S1", "S2")), ("IJBC", ("G1", "G2"))):
        write_ijb(dest / target, faces, [(1, 2, 1), (3, 4, 1), (1, 3, 0)], target.lower())
        # 1:N: templates 1 (subject 1) and 3 (subject 2) the gallery, 2 and 4 the probes.
        lists = {f"gallery_{galleries[0]}": "1,1,1.png", f"gallery_{galleries[1]}": "3,2,3.png",
                 "probe_mixed": "2,1,2.png\n4,2,4.png"}
        for name, rows in lists.items():
            (dest / target / "meta" / f"{target.lower()}_1N_{name}.csv").write_text(
                f"TEMPLATE_ID,SUBJECT_ID,FILENAME\n{rows}\n")


def _megaface(dest: Path, _fx: Fixtures) -> None:
    """insightface's MegaFace testsuite data/ folder: 5 FaceScrub images, 10 distractors (the
    smallest default size)."""
    from tests.eval_helpers import write_megaface
    data = write_megaface(dest)
    first = data / "megaface_images" / "0" / "0" / "d1.png"
    extra = [f"0/2/e{i}.png" for i in range(6)]
    for name in extra:
        (data / "megaface_images" / name).parent.mkdir(exist_ok=True)
        shutil.copy(first, data / "megaface_images" / name)
    with (data / "megaface_lst").open("a") as lst:
        lst.write("\n".join(extra) + "\n")


def _tinyface(dest: Path, _fx: Fixtures) -> None:
    """TinyFace's Testing_Set: 2 probes, 3 matched gallery images, 1 distractor."""
    from tests.eval_helpers import write_tinyface
    write_tinyface(dest)


def _rfw(dest: Path, fx: Fixtures) -> None:
    """RFW in both its forms: the released folder (test/txts/<group>/<group>_pairs.txt and
    112x112 images) and one .bin per group (the ORL pairs under each group's name), which
    ``launch.evaluate`` prefers and ``launch.overlap`` reads."""
    from tests.eval_helpers import write_rfw
    write_rfw(dest, weak={"African": 1})
    for group in ("African", "Asian", "Caucasian", "Indian"):
        shutil.copy(fx.path("bins/lfw.bin"), dest / f"{group}_test.bin")


def _faces_emore(dest: Path, fx: Fixtures) -> None:
    """An insightface .rec folder (1,100 images of 11 classes: one step of 8 GPUs x 128) with
    its verification bins."""
    from tests.data_pipeline.test_data_recordio import ir_payload, jpeg, write_rec
    dest.mkdir(parents=True)
    write_rec(dest, {i: ir_payload(i % 11, jpeg(i)) for i in range(1100)}, num_classes=11)
    _bins(dest / "bins", fx)
    for name in ("lfw.bin", "cfp_fp.bin", "agedb_30.bin"):
        (dest / "bins" / name).rename(dest / name)
    (dest / "bins").rmdir()


_ARCFACE_CONFIG = f"""from easydict import EasyDict as edict

# a tiny job under a real recipe's name: its network, class count and batch sized for a CPU
config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.network = "mbf"
config.embedding_size = {EMBEDDING}
config.sample_rate = 0.2
config.fp16 = True
config.batch_size = 4
config.lr = 0.1
config.rec = "/train_tmp/WebFace42M"
config.num_classes = {SMALL_CLASSES}
config.num_image = {SMALL_CLASSES * 4}
config.num_epoch = 2
config.warmup_epoch = 0
config.val_targets = []
"""


def _arcface_configs(dest: Path, _fx: Fixtures) -> None:
    from tests.offline.test_insightface_config import BASE
    dest.mkdir(parents=True)
    (dest / "base.py").write_text(BASE)
    (dest / "wf42m_pfc02_r100.py").write_text(_ARCFACE_CONFIG)


def _arcface_run(dest: Path, _fx: Fixtures) -> None:
    """What train_v2.py leaves on 2 GPUs after 1 step (checkpoint_gpu_0/1.pt, model.pt)."""
    from tests.offline.test_insightface_import import C, D, write_arcface_torch_run
    assert (C, D) == (SMALL_CLASSES, EMBEDDING)
    write_arcface_torch_run(dest, world=2, step=1, epoch=0, network="mbf")


def _arcface_model(dest: Path, _fx: Fixtures) -> None:
    """A folder holding only its model.pt: a MobileFaceNet, which the converter tells by its
    keys."""
    import torch

    from partial_fc.backbones import build_backbone
    dest.mkdir(parents=True)
    torch.manual_seed(0)
    torch.save(build_backbone("mbf", embedding_size=EMBEDDING).state_dict(), dest / "model.pt")


BUILDERS: dict[str, Callable[[Path, Fixtures], None]] = {
    "shards": _synthetic(64, 40),  # one step of 16 ranks x 128 (the recipes' --check)
    "small_shards": _synthetic(SMALL_CLASSES, 4),
    "other_shards": _synthetic(12, 4),
    "run": _trained(),
    "subcenter_run": _trained("margin.type=arcface", "margin.subcenters=3"),
    "bins": _bins,
    "ijb": _ijb,
    "megaface": _megaface,
    "tinyface": _tinyface,
    "rfw": _rfw,
    "faces_emore": _faces_emore,
    "arcface_configs": _arcface_configs,
    "arcface_run": _arcface_run,
    "arcface_model": _arcface_model,
}


class Fixtures:
    """Builds each fixture once, under ``root``; ``python`` runs a Python command in the docs'
    environment (a copy of the repository)."""

    def __init__(self, root: Path, python: Callable[..., None]) -> None:
        self.root, self.python = root, python

    def path(self, value: str) -> str:
        """A placeholder's value: ``=literal`` as is, else the fixture's path."""
        if value.startswith("="):
            return value[1:]
        name, _, part = value.partition("/")
        dest = self.root / name
        if not dest.exists():
            try:
                BUILDERS[name](dest, self)
            except BaseException:
                shutil.rmtree(dest, ignore_errors=True)  # built again by the next use
                raise
        return str(dest / part) if part else str(dest)


def table(doc: str) -> dict[str, str]:
    """The placeholders of one doc."""
    return {**PLACEHOLDERS, **DOC_PLACEHOLDERS.get(doc, {})}


def printed_table(doc: str) -> dict[str, str]:
    """The placeholders of the commands printed while running one doc's commands."""
    return {**table(doc), **PRINTED_PLACEHOLDERS}


def run_python(cwd: Path, env: dict) -> Callable[..., None]:
    """``python ARGS`` in ``cwd`` with ``env``; a failure raises with the output's tail."""
    def python(*args: str) -> None:
        r = subprocess.run(["python", *args], cwd=cwd, env=env, capture_output=True, text=True)
        if r.returncode:
            tail = "\n".join((r.stdout + r.stderr).splitlines()[-15:])
            raise RuntimeError(f"building a fixture: python {' '.join(args)}: exit "
                               f"{r.returncode}\n{tail}")
    return python
