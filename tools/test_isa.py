"""``make test-isa``: the tests that run bf16/fp16 CPU kernels (pytest marker ``half``) under
each instruction set this CPU has, as a CPU of that kind would present it.

Which kernels a bf16 or fp16 operation runs, and so the order of its sums and where it
rounds, is decided by the CPU: ATen picks its vectorised kernels by ``ATEN_CPU_CAPABILITY``
(default, avx2, avx512), oneDNN (convolutions, bf16/fp16 matmuls, attention's blocks) by
``ONEDNN_MAX_CPU_ISA``, each up to what the CPU has. A test whose tolerance holds on the CPU
it was written on and not on another is found here, on one machine. Each setting pairs the two
as a CPU of that kind would: ATen at avx2 beside oneDNN at AVX-512 is no real CPU (torch
2.13's bf16 attention then stops: "pack_vnni2 is only supported when avx512 is supported").
An instruction set the CPU lacks is skipped with one line (its flags, from /proc/cpuinfo).

``ISAS="avx2 default" make test-isa`` runs some of them; ``PYTEST_ARGS`` adds pytest options.
Exit status 1 when a setting's tests fail.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

# name -> (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, the /proc/cpuinfo flags it needs);
# "native": no variable, the CPU's best (here AMX where the CPU has it).
SETTINGS = {
    "native": (None, None, ()),
    "avx512-fp16": ("avx512", "AVX512_CORE_FP16", ("avx512_fp16", "avx512_bf16")),
    "avx512-bf16": ("avx512", "AVX512_CORE_BF16", ("avx512_bf16",)),
    "avx512": ("avx512", "AVX512_CORE", ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
    "avx2": ("avx2", "AVX2", ("avx2", "fma")),
    "default": ("default", "SSE41", ("sse4_1",)),
}
PYTEST = ["-q", "-p", "no:cacheprovider", "-n", "2", "-m", "half and not long", "tests"]
# ATen's capability as the run sees it, printed before pytest starts (the variable is read once)
SHOW = ("import sys, torch, pytest; print('ATen capability:', "
        "torch.backends.cpu.get_cpu_capability(), flush=True); sys.exit(pytest.main(sys.argv[1:]))")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of the first processor in ``/proc/cpuinfo``'s text."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def environment(aten: str | None, onednn: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    env.update({k: v for k, v in (("ATEN_CPU_CAPABILITY", aten),
                                  ("ONEDNN_MAX_CPU_ISA", onednn)) if v})
    return env


def main() -> int:
    flags = cpu_flags(Path("/proc/cpuinfo").read_text())
    names = os.environ.get("ISAS", "").split() or list(SETTINGS)
    extra = shlex.split(os.environ.get("PYTEST_ARGS", ""))
    failed = []
    for name in names:
        aten, onednn, needs = SETTINGS[name]
        missing = [f for f in needs if f not in flags]
        if missing:
            print(f"test-isa: {name} skipped: this CPU lacks {', '.join(missing)}", flush=True)
            continue
        shown = " ".join(f"{k}={v}" for k, v in (("ATEN_CPU_CAPABILITY", aten),
                                                 ("ONEDNN_MAX_CPU_ISA", onednn)) if v)
        print(f"test-isa: {name} ({shown or 'no variable'})", flush=True)
        start = time.perf_counter()
        code = subprocess.call([sys.executable, "-c", SHOW, *PYTEST, *extra],
                               env=environment(aten, onednn))
        print(f"test-isa: {name}: {'passed' if code == 0 else f'FAILED (exit {code})'} in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        if code:
            failed.append(name)
    if failed:
        print(f"test-isa: failed under {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
