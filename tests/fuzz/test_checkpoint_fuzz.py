"""Fuzzing what a run folder holds, read back: a resume (``launch.train`` on a finished run's
folder, its ``main`` in this process) with a checkpoint's ``meta.json``, tensors, ``latest``,
the run's ``metrics.jsonl`` or its lease replaced, and ``launch.export`` / ``launch.embed`` on
a tampered checkpoint. Whatever the files hold: the program's exit status is 0, or its error
is one line (exit status 2 where the input is refused, 1 where a checkpoint stops a run:
``trainer.errors``); never a traceback; within the bounds of tests/fuzz/bounds.py (the
ONNX-free ``--format safetensors`` export; a resume that goes on trains one step, so those
cases get the training's own time).

Seeds: each file of a 2-step run's last checkpoint damaged (flipped bits, huge numbers,
truncations), its ``meta.json`` with any key of another type or missing, nested 10^5 deep,
NaN, not UTF-8.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from eval_helpers import make_run
from hypothesis import given
from hypothesis import strategies as st
from launch_helpers import train_in_process

from data_pipeline.synthetic import write_synthetic_dataset
from launch.embed import main as embed
from launch.export import main as export
from tests.fuzz.bounds import damaged, figures, fuzz_settings, json_documents, run_main

TAG = "checkpoints/step-00000002"


def _damage(data, folder: Path, name: str) -> bytes:
    original = (folder / name).read_bytes()
    if name.endswith("meta.json"):
        return data.draw(json_documents(json.loads(original)))
    return data.draw(damaged(original) if original else st.binary(max_size=64))


def _judged(tracked, ran, what: str) -> None:
    """Exit 0, or one error line and no traceback (progress, log and usage lines aside)."""
    assert "Traceback" not in ran.err + ran.out, ran.err[-2000:]
    if ran.status != 0:
        errors = [line for line in ran.lines if "error: " in line]
        assert ran.status in (1, 2) and len(errors) == 1, (ran.status, ran.err[-2000:])
    tracked.count(f"{what}: exit {ran.status}")


@pytest.fixture(scope="module")
def checkpoint_figures():
    with figures("checkpoint: resume (launch.train), launch.export, launch.embed") as tracked:
        yield tracked


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A synthetic folder and a finished 2-step run on it (a checkpoint at each step)."""
    root = tmp_path_factory.mktemp("trained")
    write_synthetic_dataset(root / "data", num_classes=4, images_per_class=4)
    assert train_in_process(root / "data", root / "run", "train.epochs=1",
                            "checkpoint.every=1") == 0
    return root / "data", root / "run"


RUN_FILES = [f"{TAG}/meta.json", f"{TAG}/meta.json", f"{TAG}/backbone.pt", f"{TAG}/rng-0.pt",
             f"{TAG}/state/.metadata", "checkpoints/latest", "metrics.jsonl", ".lock"]


@fuzz_settings(examples=6)
@given(data=st.data())
def test_resume(trained, checkpoint_figures, data):
    folder, run = trained
    name = data.draw(st.sampled_from(RUN_FILES))
    blob = _damage(data, run, name)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(shutil.copytree(run, Path(tmp) / "run"))
        (copy / name).write_bytes(blob)
        ran, error = checkpoint_figures.measure(lambda: run_main(
            lambda _: train_in_process(folder, copy, "train.epochs=1", "checkpoint.every=1"),
            []))
    assert error is None, error
    _judged(checkpoint_figures, ran, f"resume, {name.rsplit('/', 1)[-1]}")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("export"))


@fuzz_settings(examples=6)
@given(data=st.data(), program=st.sampled_from(["export", "export", "embed"]))
def test_export_and_embed(small_run, trained, checkpoint_figures, data, program):
    tag = "checkpoints/step-00000010"
    name = data.draw(st.sampled_from([f"{tag}/meta.json", f"{tag}/backbone.pt",
                                      "checkpoints/latest", "config.yaml"]))
    blob = _damage(data, small_run, name)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(shutil.copytree(small_run, Path(tmp) / "run"))
        (copy / name).write_bytes(blob)
        argv = ["--checkpoint", str(copy), "--out", f"{tmp}/out"]
        if program == "export":
            ran, error = checkpoint_figures.measure(lambda: run_main(
                export, [*argv, "--format", "safetensors", "--license", "MIT"]))
        else:
            ran, error = checkpoint_figures.measure(lambda: run_main(
                embed, [*argv, "--data", str(trained[0]), "--device", "cpu"]))
    assert error is None, error
    _judged(checkpoint_figures, ran, f"{program}, {name.rsplit('/', 1)[-1]}")
