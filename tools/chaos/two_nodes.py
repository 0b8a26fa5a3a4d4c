"""Two nodes with a shared file system: a 2-node job (one rank per node, on the two network
namespaces of :mod:`tools.testbed.nodes`) computes a 1-node 2-rank job's losses, and a cut
link ends it in one line a node and a resumable checkpoint."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tools.testbed.harness import train, wait_for_step
from tools.testbed.nodes import NoNamespaces, train_on_nodes, two_nodes


def two_node_case(data: Path, work: Path, engine: str) -> tuple[str, bool]:
    """2 nodes x 1 rank: the loss equals a 1-node 2-rank run's at step 6; then a run whose
    link is cut after step 3 for longer than the 10 s timeout ends on both nodes with one
    line each; plugged again, the rerun resumes from the step-2 checkpoint and finishes."""
    try:
        with two_nodes() as nodes:
            two = train_on_nodes(nodes, data, work / "two", f"engine.type={engine}")
            one = train(data, work / "one", f"engine.type={engine}", ranks=2)
            loss = [(r.records() or [{}])[-1].get("loss") for r in (two[0], one)]
            same = None not in loss and abs(loss[0] - loss[1]) <= 1e-5 * abs(loss[1])

            def cut(procs: list[subprocess.Popen]) -> None:
                wait_for_step(work / "cut", 3, procs[0])  # step 2 saved in full
                nodes.link(up=False)

            cut_run = train_on_nodes(nodes, data, work / "cut", f"engine.type={engine}",
                                     "train.max_steps=200", "dist.timeout_s=10", during=cut)
            nodes.link(up=True)
            lines = [[ln for ln in r.out.splitlines() if ln.startswith("error on rank")]
                     for r in cut_run]
            ended = all(r.rc != 0 for r in cut_run) and all(
                len(found) == 1 and "dist.timeout_s=10" in found[0] for found in lines)
            again = train_on_nodes(nodes, data, work / "cut", f"engine.type={engine}",
                                   "train.max_steps=8")
            resumed = all(r.rc == 0 for r in again) and "resumed from" in again[0].out \
                and (again[0].records() or [{}])[-1].get("step") == 8
    except NoNamespaces as err:
        return f"skipped: {err}", True
    return (f"loss at step 6: 2 nodes {loss[0]}, 1 node {loss[1]}; cut: rc "
            f"{[r.rc for r in cut_run]}, lines {[f[0][:60] if f else None for f in lines]}; "
            f"rerun rc {[r.rc for r in again]}, resumed {resumed}"), same and ended and resumed
