"""Launch configurations of the head's class-tile kernels, chosen by measurement per device.

A configuration (:class:`Choice`) is the engine (``"triton"``: the Triton GEMMs of
``partial_fc.tiles.triton``; ``"cublas"``: torch matmuls per class chunk with Triton epilogues,
``partial_fc.tiles.cublas``) and the tiles: block sizes, warps, stages and the programs the
class and K splits aim at per multiprocessor. Which one is fastest depends on the card and on
the step's shape, so winners are looked up by device name and shape bucket (:class:`Shape`):

1. the committed table, :data:`TABLE` (``tuned.json`` beside this file, package data),
   filled by a GPU session's sweep (``bench/tune.py``; empty for a device never lent);
2. the per-user cache, :func:`cache_path` (``$XDG_CACHE_HOME/partial_fc``, else
   ``~/.cache/partial_fc``; one file per triton version), where a device that is not in the
   table keeps what it tuned at its first use (``partial_fc.tiles.autotune`` measures).

This module is the data: no triton import, no measurement. Nothing is read at import; the
table is read once when first asked for, the cache each time a bucket is missing.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

__all__ = ["DEFAULT", "ENGINES", "TABLE", "Choice", "Device", "Shape", "cache_path",
           "cached", "candidates", "device_info", "note", "remember", "tabled", "take_notes"]

TABLE = Path(__file__).with_name("tuned.json")
"""The committed winners: ``{"devices": {name: {"measured": {...}, "buckets": {key: choice}}}}``."""

ENGINES = ("triton", "cublas")


@dataclass(frozen=True)
class Choice:
    """One launch configuration. ``rows`` x ``cols``: a cosine tile (``BLOCK_N`` x
    ``BLOCK_S``; the cuBLAS engine's epilogue tile); ``depth``: the dot's D loop and the
    GEMMs' K loop; ``gemm``: the GEMMs' square output tile; ``programs_per_sm``: what the
    class splits (forward) and K splits (``grad_e``) aim at, per multiprocessor."""

    engine: str
    rows: int
    cols: int
    depth: int
    gemm: int
    num_warps: int
    num_stages: int
    programs_per_sm: int

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, entry: dict) -> Choice:
        """The choice an entry of the table or the cache names; a ``ValueError`` naming the
        entry when a field is missing, unknown or out of range."""
        names = {f.name for f in fields(cls)}
        if set(entry) != names:
            raise ValueError(f"tiles table entry {entry}: expected the fields {sorted(names)}")
        choice = cls(**entry)
        sizes = (choice.rows, choice.cols, choice.depth, choice.gemm, choice.num_warps)
        if choice.engine not in ENGINES or not all(v >= 1 and v & (v - 1) == 0 for v in sizes) \
                or choice.num_stages < 1 or choice.programs_per_sm < 1:
            raise ValueError(f"tiles table entry {entry}: engine must be one of {ENGINES}, "
                             "block sizes and warps powers of two, stages and programs >= 1")
        return choice


DEFAULT = Choice("triton", 128, 64, 64, 128, num_warps=8, num_stages=3, programs_per_sm=4)
"""The configuration chosen before any measurement (``partial_fc.tiles.triton.cuda_tiles``,
whose ptxas figures docs/kernels.md lists): used for shapes too small to tune."""


def candidates(capability: tuple[int, int]) -> list[Choice]:
    """The few configurations a tuning times, :data:`DEFAULT` first: 4 warps on small tiles
    (64 x 64 with a 32-deep loop and 4 stages, 128 x 64 with 5) at 8 programs per SM, with
    64 x 64 GEMM tiles; the cuBLAS engine; on sm_90 (Hopper) also the 128 x 128 cosine tile,
    a warpgroup MMA's natural shape, at 2 programs per SM with 3 and 4 stages (4 stages take
    176 KiB of shared memory, which only Hopper has per block). Each compiles without spills
    for the devices it is offered on (``python -m tools.kernels_aot --candidates``: ptxas,
    bf16 operands with fp32 or bf16 state); 4 warps on 128 x 128 GEMM tiles and any
    256-wide cosine tile spilled on sm_90, the 128 x 128 cosine tile on sm_80."""
    small = [Choice("triton", 64, 64, 32, 64, num_warps=4, num_stages=4, programs_per_sm=8),
             Choice("triton", 128, 64, 32, 64, num_warps=4, num_stages=5, programs_per_sm=8),
             Choice("cublas", 64, 128, 64, 128, num_warps=4, num_stages=1, programs_per_sm=4)]
    if capability < (9, 0):
        return [DEFAULT, *small]
    return [DEFAULT, *small, *(Choice("triton", 128, 128, 64, 128, num_warps=8,
                                      num_stages=stages, programs_per_sm=2)
                               for stages in (3, 4))]


@dataclass(frozen=True)
class Device:
    """What the tuner keys on: the device's name as CUDA reports it, its multiprocessors and
    its compute capability."""

    name: str
    sms: int
    capability: tuple[int, int]


def device_info(device: torch.device) -> Device | None:
    """The CUDA device ``device`` is, or None for any other device (the interpreter's
    tensors, which are never tuned). The one place the tuner reads the hardware."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return Device(props.name, props.multi_processor_count, (props.major, props.minor))


_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Shape:
    """The bucket of a step's shape: ``N`` (rows) to the nearest power of two, ``S`` (the
    sampled classes) to the nearest power of four, ``D`` to the nearest power of two, and
    the dtypes of ``e`` and ``w``. The shapes users run fall in distinct buckets (``N`` 512,
    1024, 2048; ``S`` = ``C_local r``: 10k, 100k, 400k, 1M, 4M)."""

    n: int
    s: int
    d: int
    e: str
    w: str

    @classmethod
    def of(cls, n: int, s: int, d: int, e_dtype: torch.dtype, w_dtype: torch.dtype) -> Shape:
        def nearest(x: int, base: int) -> int:
            return base ** max(0, round(math.log(max(x, 1), base)))

        return cls(nearest(n, 2), nearest(s, 4), nearest(d, 2), _DTYPES[e_dtype],
                   _DTYPES[w_dtype])

    @property
    def key(self) -> str:
        return f"N{self.n}-S{self.s}-D{self.d}-{self.e}-{self.w}"


@functools.cache
def _table(path: Path) -> dict:
    return json.loads(path.read_text())["devices"]


def tabled(device: Device, shape: Shape, table: Path = TABLE) -> Choice | None:
    """The committed table's choice for this device and bucket, if it has one."""
    entry = _table(table).get(device.name, {}).get("buckets", {}).get(shape.key)
    return None if entry is None else Choice.from_json(entry)


def cache_path() -> Path:
    """This user's cache of first-use tunings for the installed triton (a kernel's speed
    follows the compiler): ``$XDG_CACHE_HOME/partial_fc/tiles-triton<version>.json``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        version = "none"
    return Path(root) / "partial_fc" / f"tiles-triton{version}.json"


def _read_cache(path: Path) -> dict:
    """The cache's devices; an unreadable file counts as empty (it is rewritten whole)."""
    try:
        return json.loads(path.read_text())["devices"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def cached(device: Device, shape: Shape, path: Path) -> Choice | None:
    """The cache's choice for this device and bucket, if it has a valid one."""
    entry = _read_cache(path).get(device.name, {}).get("buckets", {}).get(shape.key)
    try:
        return None if entry is None else Choice.from_json(entry)
    except (TypeError, ValueError):
        return None


def remember(device: Device, shape: Shape, choice: Choice, path: Path) -> None:
    """Add ``choice`` to the cache at ``path``, written whole to a temporary file and renamed
    over it, so that a reader (another rank tuning the same card) never sees half a file."""
    devices = _read_cache(path)
    devices.setdefault(device.name, {}).setdefault("buckets", {})[shape.key] = choice.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump({"devices": devices}, f, indent=1, sort_keys=True)
    os.replace(f.name, path)


_notes: list[str] = []


def note(line: str) -> None:
    """Keep a line for the user: a choice made, and where it came from."""
    _notes.append(line)


def take_notes() -> list[str]:
    """The lines kept since the last call (``PartialFC.take_notes`` passes them on)."""
    out = _notes[:]
    _notes.clear()
    return out
