"""What every fuzz target of tests/fuzz holds each case to, and the inputs it starts from.

A case ends within :data:`SECONDS` and :data:`MEMORY` above the process's resident size when
it starts, with a one-line refusal (an error of the reader's own kinds, or a program's exit
status 2 and one line on stderr), a skipped-and-counted sample, or a valid result; never a
traceback. The memory is the peak resident size, C allocations included (libjpeg's buffers
are not Python objects): Linux resets a process's high-water mark when ``5`` is written to
``/proc/self/clear_refs``, so each case is measured in this process, from its own start.

``FUZZ_SCALE`` scales every target's number of generated cases (``make test``: 1; ``make
fuzz``: more). With ``FUZZ_REPORT`` set, each target appends its figures (cases, slowest,
largest) to that file as a JSON line; ``make fuzz`` prints them (docs/readers.md).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from PIL import Image

SECONDS = 5.0
MEMORY = 512 << 20
SCALE = float(os.environ.get("FUZZ_SCALE", "1"))
MESSAGE_CHARS = 2000  # a one-line message is bounded too (a value shown cut, never whole)
PROGRESS = re.compile(r"\d+/\d+ \[\d|/s\]$|\|\s*$")  # a tqdm bar's line


def fuzz_settings(examples: int):
    """Seeded (the same cases every run), no example database, ``examples`` x the scale."""
    return settings(max_examples=max(1, round(examples * SCALE)), derandomize=True,
                    database=None, deadline=None, print_blob=False,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def _status(name: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{name}:\s+(\d+) kB", f.read(), re.M).group(1)) << 10


@dataclass
class Figures:
    """One target's cases: how many, the slowest and the largest."""

    target: str
    cases: int = 0
    max_s: float = 0.0
    max_bytes: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    last: tuple[float, int] = (0.0, 0)  # the latest case's seconds and bytes

    def measure(self, run: Callable[[], object]) -> tuple[object, BaseException | None]:
        """``run()``'s value or exception, after checking its time and peak memory."""
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base, start = _status("VmRSS"), time.perf_counter()
        value, error = None, None
        try:
            value = run()
        except Exception as exc:  # judged by the caller: a refusal of the right kind or a bug
            error = exc
        seconds, grown = time.perf_counter() - start, _status("VmHWM") - base
        self.cases += 1
        self.max_s, self.max_bytes = max(self.max_s, seconds), max(self.max_bytes, grown)
        self.last = seconds, grown
        assert seconds < SECONDS, f"{self.target}: {seconds:.1f} s"
        assert grown < MEMORY, f"{self.target}: {grown >> 20} MiB above the start"
        return value, error

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def report(self) -> None:
        path = os.environ.get("FUZZ_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"target": self.target, "cases": self.cases,
                                    "max_s": round(self.max_s, 3),
                                    "max_mib": round(self.max_bytes / 2**20, 1),
                                    "outcomes": self.outcomes}) + "\n")


@contextlib.contextmanager
def figures(target: str) -> Iterator[Figures]:
    """A target's :class:`Figures`, reported when its cases are done."""
    tracked = Figures(target)
    yield tracked
    tracked.report()


def one_line(error: BaseException, kinds: tuple[type[BaseException], ...]) -> str:
    """``error``'s message, after checking it is one of ``kinds`` and one bounded line."""
    assert error is not None, "accepted"
    if not isinstance(error, kinds):
        raise error
    message = str(error)
    assert "\n" not in message and 0 < len(message) < MESSAGE_CHARS, message[:MESSAGE_CHARS]
    return message


@dataclass(frozen=True)
class Ran:
    """A program's ``main`` run in this process: exit status and what it printed."""

    status: int
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        """stderr's lines, progress bars left out (tqdm reads ``TQDM_DISABLE`` at import)."""
        lines = (line.rsplit("\r", 1)[-1] for line in self.err.split("\n"))
        return [line for line in lines if line.strip() and not PROGRESS.search(line)]

    def refused(self) -> str:
        """The one line of a refusal (exit status 2), after checking it is one."""
        lines = self.lines
        assert self.status == 2 and len(lines) == 1, (self.status, self.err[-MESSAGE_CHARS:])
        assert "Traceback" not in self.err and len(lines[0]) < MESSAGE_CHARS
        return lines[0]


def run_main(main: Callable[[list[str]], int], argv: list[str]) -> Ran:
    """``main(argv)`` with stdout and stderr captured; argparse's exits count as returns."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 2
    return Ran(status, out.getvalue(), err.getvalue())


# Generated inputs: what a damaged or hostile copy of a valid file looks like.
HUGE = (0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFF, 0x7FFF, 1 << 29, (1 << 29) - 1, 60000)


def _flip(data: bytes, bits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for at, bit in bits:
        out[at % len(out)] ^= 1 << bit
    return bytes(out)


def _put(data: bytes, at: int, packed: bytes) -> bytes:
    at %= max(1, len(data) - len(packed) + 1)
    return data[:at] + packed + data[at + len(packed):]


def damaged(seed: bytes, keep_size: bool = False) -> st.SearchStrategy[bytes]:
    """Copies of ``seed``: truncated (unless ``keep_size``), bits flipped, bytes overwritten,
    a huge number written over any 2, 4 or 8 bytes (a declared size or dimension), or
    replaced by random bytes of its size."""
    n = len(seed)
    kinds = [
        st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 7)), min_size=1,
                 max_size=8).map(lambda bits: _flip(seed, bits)),
        st.tuples(st.integers(0, n - 1), st.binary(min_size=1, max_size=16)).map(
            lambda p: _put(seed, p[0], p[1])),
        st.tuples(st.integers(0, n - 1), st.sampled_from(HUGE),
                  st.sampled_from(["<H", ">H", "<I", ">I", "<Q"])).map(
            lambda p: _put(seed, p[0], struct.pack(p[2], p[1] % (1 << 8 * struct.calcsize(p[2]))))),
        st.binary(min_size=n, max_size=n),
    ]
    if not keep_size:
        kinds.append(st.integers(0, n - 1).map(lambda i: seed[:i]))
    return st.one_of(kinds)


def face(fmt: str, size: int = 112) -> bytes:
    """A smooth ``size`` x ``size`` colour image (as an optimised JPEG, 750 bytes at 112)."""
    ramp = np.repeat(np.linspace(0, 255, size, dtype=np.uint8)[None], size, 0)
    out = io.BytesIO()
    Image.fromarray(np.stack([ramp, ramp.T, ramp], -1)).save(out, format=fmt, quality=50,
                                                             optimize=True)
    return out.getvalue()


def claiming(data: bytes, width: int, height: int) -> bytes:
    """The JPEG ``data`` with its frame header (SOF0/1/2) edited to claim width x height."""
    out, at = bytearray(data), 2
    while out[at + 1] not in (0xC0, 0xC1, 0xC2):
        at += 2 + struct.unpack(">H", out[at + 2:at + 4])[0]
    out[at + 5:at + 9] = struct.pack(">HH", height, width)
    return bytes(out)


JPEG, PNG = face("JPEG"), face("PNG")
BOMB = claiming(JPEG, 60000, 60000)  # the file: 10.5 GB and 31-75 s before the limit


def _deep(depth: int, opener: str) -> str:
    closer = {"[": "]", "{": "}"}[opener]
    inner = '{"a": ' if opener == "{" else "["
    return inner * depth + "1" + closer * depth


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=16)


def json_documents(seed: dict) -> st.SearchStrategy[bytes]:
    """JSON files a reader of ``seed``'s kind may meet: ``seed`` with one key's value of
    another type or removed, another JSON value, nesting 10^5 deep, NaN and Infinity,
    huge numbers, not UTF-8, and ``seed``'s text damaged."""
    text = json.dumps(seed).encode()
    keys = sorted(seed)

    def retyped(p: tuple[str, object]) -> bytes:
        return json.dumps({**seed, p[0]: p[1]}).encode()

    return st.one_of(
        st.tuples(st.sampled_from(keys), JSON_VALUES | st.sampled_from(
            [float("nan"), float("inf"), 10 ** 30, -1, 2 ** 63, "x" * 10000])).map(retyped),
        st.sampled_from(keys).map(lambda k: json.dumps(
            {x: v for x, v in seed.items() if x != k}).encode()),
        JSON_VALUES.map(lambda v: json.dumps(v).encode()),
        st.sampled_from(["[", "{"]).map(lambda o: _deep(100_000, o).encode()),
        st.just(b"\xff\xfe\x00garbage"),
        damaged(text),
    )


@dataclass(frozen=True)
class Program:
    """A program run as a user runs it (``python -m MODULE ARGS``): exit status, stderr, its
    CPU seconds and peak resident size (``wait4``'s rusage: a loaded machine stretches the
    wall time of a start-up, not its CPU time)."""

    status: int
    err: str
    cpu_s: float
    peak_bytes: int

    def refused(self) -> str:
        return Ran(self.status, "", self.err).refused()


def run_program(module: str, *args: str, cwd: str | None = None) -> Program:
    """``python -m module args`` in a subprocess, ``TQDM_DISABLE`` set (a user's log has its
    progress; the check wants the lines), killed past twice :data:`SECONDS` plus start-up."""
    env = {**os.environ, "TQDM_DISABLE": "1"}
    with subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as child:
        timer = threading.Timer(2 * SECONDS + 30, child.kill)
        timer.start()
        err = child.stderr.read().decode(errors="replace")
        _, status, usage = os.wait4(child.pid, 0)
        timer.cancel()
        child.returncode = os.waitstatus_to_exitcode(status)
    return Program(child.returncode, err, usage.ru_utime + usage.ru_stime, usage.ru_maxrss << 10)


def print_figures(report: str) -> None:
    """The targets' figures of a ``FUZZ_REPORT`` file, summed per target, as a Markdown
    table (``make fuzz`` prints it; docs/readers.md keeps one)."""
    rows: dict[str, Figures] = {}
    with open(report) as f:
        for line in f:
            got = json.loads(line)
            row = rows.setdefault(got["target"], Figures(got["target"]))
            row.cases += got["cases"]
            row.max_s = max(row.max_s, got["max_s"])
            row.max_bytes = max(row.max_bytes, round(got["max_mib"] * 2**20))
            for outcome, count in got["outcomes"].items():
                row.outcomes[outcome] = row.outcomes.get(outcome, 0) + count
    print(f"| target | cases | slowest (s, bound {SECONDS:g}) | largest (MiB above start, "
          f"bound {MEMORY >> 20}) | outcomes |\n| --- | --- | --- | --- | --- |")
    for row in rows.values():
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(row.outcomes.items()))
        print(f"| {row.target} | {row.cases} | {row.max_s:.2f} | {row.max_bytes / 2**20:.1f} "
              f"| {outcomes} |")


if __name__ == "__main__":
    print_figures(sys.argv[1])
