"""Optional compiled kernels for the class-tiled margin softmax head.

``partial_fc.kernels.triton_margin`` holds Triton kernels for the two class-tile passes of the
chunked head (statistics forward, recomputing backward). Triton is an optional dependency: this
package imports nothing at import time, and importing ``triton_margin`` without triton raises an
``ImportError`` that says so. ``triton_available()`` asks without importing it.
"""

from __future__ import annotations

import importlib.util

__all__ = ["triton_available"]


def triton_available() -> bool:
    """Whether ``import triton`` would find a package (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None
