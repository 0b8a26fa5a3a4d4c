"""``trainer.host_heap``: a CPU run of the training program reuses freed heap blocks instead of
having the kernel map and zero them again each step; an in-process caller of
``launch.train.main`` keeps glibc's defaults unless it asks.

Measured in a fresh interpreter (the setting lasts as long as the process, and the pytest
worker must keep its own): the minor page faults of allocating, touching and freeing a
64 MiB tensor, over rounds 11-20 of 20. Under glibc's defaults each round faults its 16,384
pages in again. With freed blocks kept, the first rounds still grow the heap (torch asks for
64-byte aligned blocks, which a freed block of the same size does not always hold: the heap
settled at 595 MB for this 64 MiB block, measured) and the later ones fault nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launch_helpers import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

PAGES = (64 << 20) // 4096  # the tensor's pages, each faulted in when it is mapped afresh

SCRIPT = """
import json, resource, sys
import torch
from launch import train

def faults_of_later_rounds():
    rounds = []
    for _ in range(20):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(16 << 20).fill_(1.0)  # 64 MiB, freed at once
        rounds.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return sum(rounds[10:])  # once the heap has settled

def one_step(run, keep):
    argv = ["--config", "configs/smoke.yaml", "data.source=synthetic", "data.num_classes=20",
            "engine.type=ddp", "train.max_steps=1", "log.wandb=disabled", "log.progress=false",
            "data.num_workers=0", "checkpoint.every=0", f"output={run}"]
    assert train.main(argv, keep_host_heap=keep) == 0

out = {"untouched": faults_of_later_rounds()}
one_step(sys.argv[1] + "/in-process", False)
out["in_process"] = faults_of_later_rounds()
one_step(sys.argv[1] + "/program", True)
out["program"] = faults_of_later_rounds()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_cpu_run_of_the_program_keeps_freed_blocks_and_an_in_process_caller_does_not(
        tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    faults = json.loads(done.stdout.strip().splitlines()[-1])
    assert faults["untouched"] >= 10 * PAGES // 2, faults  # glibc's defaults: every round
    assert faults["in_process"] >= 10 * PAGES // 2, faults  # main() left them as they were
    assert faults["program"] < PAGES // 2, faults  # kept: the settled heap reuses its blocks
