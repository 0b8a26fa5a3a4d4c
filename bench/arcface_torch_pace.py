"""Benchmark: insightface arcface_torch's own ``train_v2.py`` on this GPU, on synthetic input.

    python3 bench/arcface_torch_pace.py --insightface DIR --json out.json [--seconds 90]

DIR is a checkout of https://github.com/deepinsight/insightface (or its
``recognition/arcface_torch``; nothing of it is vendored here: bench/gpu_session.sh's ``pace``
stage carries ``.gpu/insightface``, docs/gpu.md). Its ``train_v2.py`` runs unchanged, in this
process, from a copy of ``recognition/arcface_torch`` with one config module added
(:func:`config_source`): ``rec = "synthetic"`` (its own ``SyntheticDataset``: one random
image, label 1), iresnet50, the batch, classes and sample rate given here, its mixed
precision (``fp16 = True``: fp16 autocast and a GradScaler, the only mixed precision its
``train_v2.py`` has; ours is bf16), no verification sets. A package its synthetic path never
reads and the GPU machine lacks (mxnet, torchvision, tensorboard, easydict) is stood in for by
a stub (:func:`stub_missing`), each named in the output.

It trains until ``--seconds`` pass (``train_v2.py`` has no step limit short of an epoch of
its dataset's 1,000,000 images), then reads its log: the median of its ``Speed ... samples/sec``
lines after the first ``--skip`` (warm-up, cudnn's search), and CUDA's peak allocated memory.
Prints figures, asserts nothing; not run by the test suite.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import re
import runpy
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch

SPEED = re.compile(r"Speed ([\d.]+) samples/sec")
CONFIG = "pace_r50"


def config_source(classes: int, sample_rate: float, batch: int, output: Path,
                  workers: int) -> str:
    """The config module train_v2.py reads (``configs/pace_r50.py``): ``configs/base.py``'s
    values with these changes only."""
    return "\n".join([
        "from easydict import EasyDict as edict",
        "config = edict()",
        "config.network = 'r50'",
        "config.margin_list = (1.0, 0.5, 0.0)",
        "config.embedding_size = 512",
        f"config.sample_rate = {sample_rate!r}",
        "config.fp16 = True",
        f"config.batch_size = {batch}",
        "config.lr = 0.1",
        "config.rec = 'synthetic'",
        f"config.num_classes = {classes}",
        "config.num_image = 10_000_000",
        "config.num_epoch = 1",
        "config.warmup_epoch = 0",
        "config.val_targets = []",
        "config.verbose = 10**9",
        "config.frequent = 10",
        f"config.num_workers = {workers}",
        f"config.output = {str(output)!r}",
        ""])


class _EasyDict(dict):
    """easydict's ``EasyDict``: a dict whose keys are attributes too."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError as err:
            raise AttributeError(name) from err

    def __setattr__(self, name, value):
        self[name] = value


class _Writer:
    """tensorboard's ``SummaryWriter``, writing nothing."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class _Absent:
    """What a stand-in module gives for any other name: fails if it is ever used."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.name}: a stand-in (bench/arcface_torch_pace.py); the "
                           "synthetic path was expected not to use it")

    def __getattr__(self, name: str) -> _Absent:
        return _Absent(f"{self.name}.{name}")


def _absent(module: str, attr: str) -> _Absent:
    """A stand-in module's ``__getattr__``: dunders are missing, as on any module."""
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Absent(f"{module}.{attr}")


def _stubs() -> dict[str, dict]:
    """Module name -> the attributes its stand-in has; any other name is :class:`_Absent`.
    The modules arcface_torch's train_v2.py imports for what synthetic input never runs
    (.rec files, image folders, the verification sets), its config's EasyDict, its writer."""
    return {"easydict": {"EasyDict": _EasyDict},
            "torch.utils.tensorboard": {"SummaryWriter": _Writer},
            **dict.fromkeys(("mxnet", "torchvision", "torchvision.transforms",
                             "torchvision.datasets", "scipy", "sklearn",
                             "sklearn.decomposition", "sklearn.model_selection"), {})}


def stub_missing() -> list[str]:
    """Put a stand-in in ``sys.modules`` for each of :func:`_stubs` that does not import;
    returns their names. None of them is used on the synthetic path but for the writer."""
    stubbed = []
    for name, attrs in _stubs().items():
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - absent, or present and broken: not used here
            module = types.ModuleType(name)
            module.__getattr__ = functools.partial(_absent, name)
            module.__dict__.update(attrs)
            sys.modules[name] = module
            parent, _, child = name.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, module)
            stubbed.append(name)
    return stubbed


def speeds(log: str, skip: int) -> list[float]:
    """The ``Speed`` figures of train_v2.py's log, the first ``skip`` dropped."""
    return [float(m[1]) for m in SPEED.finditer(log)][skip:]


def _arcface_torch(folder: Path) -> Path:
    for candidate in (folder / "recognition" / "arcface_torch", folder):
        if (candidate / "train_v2.py").is_file():
            return candidate
    raise SystemExit(f"error: --insightface {folder}: no train_v2.py there or in "
                     "recognition/arcface_torch (a checkout of deepinsight/insightface)")


def _commit(folder: Path) -> str | None:
    done = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    if done.returncode == 0:
        return done.stdout.strip()
    stamp = folder / "COMMIT"  # what the carried copy records (docs/gpu.md)
    return stamp.read_text().strip() if stamp.is_file() else None


def run_train_v2(work: Path, seconds: int) -> str | None:
    """``work/train_v2.py configs/pace_r50`` as ``python train_v2.py`` runs it (its folder the
    working directory and first on the path), stopped after ``seconds``; returns the error
    that ended it early, if one did. The process's path, arguments and folder are restored."""
    def stop(*_):
        raise KeyboardInterrupt

    saved = sys.path[:], sys.argv[:], os.getcwd()
    sys.path.insert(0, str(work))
    sys.argv = ["train_v2.py", f"configs/{CONFIG}"]
    os.chdir(work)
    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        runpy.run_path(str(work / "train_v2.py"), run_name="__main__")
    except KeyboardInterrupt:
        pass
    except Exception as err:  # noqa: BLE001 - reported in the JSON, with what ran
        return f"{type(err).__name__}: {err}"[:500]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        sys.path[:], sys.argv[:] = saved[0], saved[1]
        os.chdir(saved[2])
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--insightface", type=Path, required=True)
    p.add_argument("--classes", type=int, default=93_431, help="ms1mv3's")
    p.add_argument("--sample-rate", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--workers", type=int, default=8, help="its DataLoader's workers")
    p.add_argument("--seconds", type=int, default=90, help="train this long, then stop")
    p.add_argument("--skip", type=int, default=3, help="Speed lines dropped (warm-up)")
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    source = _arcface_torch(args.insightface)
    with tempfile.TemporaryDirectory(prefix="arcface-torch-") as tmp:
        work = Path(tmp) / "arcface_torch"
        shutil.copytree(source, work)
        output = Path(tmp) / "output"
        (work / "configs" / f"{CONFIG}.py").write_text(
            config_source(args.classes, args.sample_rate, args.batch, output, args.workers))
        stubbed = stub_missing()
        error = run_train_v2(work, args.seconds)
        log_file = output / "training.log"
        found = speeds(log_file.read_text() if log_file.is_file() else "", args.skip)
        result = {"img_per_s": statistics.median(found) if found else None,
                  "speeds": found, "error": error, "stubbed": stubbed,
                  "peak_gib": torch.cuda.max_memory_allocated() / 2**30
                  if torch.cuda.is_available() else None,
                  "insightface_commit": _commit(args.insightface),
                  "config": config_source(args.classes, args.sample_rate, args.batch,
                                          Path("OUTPUT"), args.workers)}
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"arcface_torch train_v2.py: {result['img_per_s']} img/s (median of {len(found)}), "
          f"peak {result['peak_gib']} GiB, stubbed {stubbed or 'nothing'}"
          + (f"; stopped by {error}" if error else ""))
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
