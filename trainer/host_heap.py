"""Keep the host heap's freed blocks for the next step: CPU training without a page fault per
tensor, as a GPU's caching allocator keeps device memory.

glibc serves an allocation above ``M_MMAP_THRESHOLD`` (128 KiB, rising to at most 32 MiB as
such blocks are freed) with a mapping of its own and gives it back to the kernel on ``free``;
below it, it returns the heap's free top once it passes ``M_TRIM_THRESHOLD``. A CPU training
step allocates its activations afresh every step (iresnet_tiny at a batch of 64: 51 MiB a
feature map, past any threshold), so every step has the kernel zero and map every page of
them again. Measured on ``bench/merge_effect.py`` at its defaults (two one-thread trainings at
a time on 2 cores, 2026-12-07): 1,808 CPU-s of system time beside 4,704 of user, 433 million
minor page faults; one iresnet_tiny step of 64 alone, 0.99-1.19 s with 28-46 thousand faults
against 0.90-0.93 s with 314.

With mappings off (``M_MMAP_MAX = 0``) and trimming off (``M_TRIM_THRESHOLD`` at 2 GiB),
a freed block stays in the heap and a later tensor reuses it. The price is the one a caching
allocator has: the process's resident memory stays at its peak instead of falling back
between steps, and the heap first grows past the live bytes before it settles (torch asks
for 64-byte aligned blocks, which a freed block of the same size does not always hold: one
64 MiB tensor allocated and freed in a loop settles the heap at 595 MB, then faults nothing).
So it is a choice of the training *program* on a CPU run (``python -m launch.train``, see
there), not of the library: a process that calls ``launch.train.main`` in-process (a test
runner, a notebook) keeps glibc's defaults.

Only glibc has these knobs (``mallopt(3)``); elsewhere (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["M_MMAP_THRESHOLD", "M_TRIM_THRESHOLD", "glibc_mallopt", "keep_freed_blocks"]

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc <malloc.h>
INT_MAX = 2**31 - 1  # mallopt takes a C int: a larger Python int would be cut to its low bits


def glibc_mallopt():
    """glibc's ``mallopt(int param, int value)`` with its argument types declared (so a value
    past a C int is refused, not silently truncated), or None where the C library is not
    glibc."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return None
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def keep_freed_blocks() -> None:
    """Turn glibc's per-block mappings and heap trimming off for this process and the
    processes it forks from now on (a loader's workers); nothing where there is no glibc."""
    mallopt = glibc_mallopt()
    if mallopt is not None:
        mallopt(M_MMAP_MAX, 0)
        mallopt(M_TRIM_THRESHOLD, INT_MAX)
