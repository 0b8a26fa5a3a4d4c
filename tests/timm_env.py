"""Importing the real timm in the test environment, whose torchvision cannot load its C++ ops.

timm imports torchvision (``timm.layers`` takes ``FrozenBatchNorm2d`` from it). PyPI's Linux
torchvision wheel is built against CUDA torch: its ``_C.so`` links ``libtorch_cuda.so``, which
the CPU torch of CI does not ship, so torchvision falls back to no custom ops. torchvision
0.28's import then fails anyway, because ``torchvision/_meta_registrations.py`` registers fake
kernels for ``torchvision::nms`` and ``torchvision::qnms`` without checking that the ops exist
(``RuntimeError: operator torchvision::nms does not exist``). Declaring those two schemas first
lets the Python package import; no timm model calls them (they are detection ops). This is a
test-environment measure: a user's torchvision built for their torch loads its ops and needs
none of it (``partial_fc.backbones.timm_adapter`` names that fix when the import fails).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

NO_TIMM = "timm is not installed (pip install 'partial-fc[timm]')"
_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_declared: list[torch.library.Library] = []  # a Library's definitions live as long as it does


def _torchvision_ops_load() -> bool:
    """Whether torchvision's ``_C`` extension loads beside this torch (found, not imported)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    found = sorted(Path(spec.submodule_search_locations[0]).glob("_C*.so"))
    try:
        torch.ops.load_library(str(found[0]))
    except (IndexError, OSError):
        return False
    return True


def import_timm():
    """The real ``timm`` module, or a skip where it is not installed."""
    if importlib.util.find_spec("timm") is None:
        pytest.skip(NO_TIMM)
    if not _declared and not _torchvision_ops_load():
        lib = torch.library.Library("torchvision", "DEF")
        for schema in _SCHEMAS:
            lib.define(schema)
        _declared.append(lib)
    import timm

    return timm
