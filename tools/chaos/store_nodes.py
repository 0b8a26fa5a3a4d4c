"""Two nodes that share no file system: a 2-node job on two network namespaces (tools.testbed.nodes)
whose data and run folder are both in an S3 store (moto's server, in node 0's namespace on its
veth address, the one address both nodes reach), each node with its own ``TMPDIR`` (its local
disk: the node's copy of the run folder). SIGTERM to every process of both nodes after step 3
saves to the store and exits 0; the rerun resumes from the store and its step-6 loss equals an
unbroken 1-node 2-rank run's on the same local data (the same batches)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from data_pipeline.store import staging_dir
from tools.testbed.harness import STEPS, signal_job, train, wait_for_step
from tools.testbed.nodes import NoNamespaces, start_on_node, train_on_nodes, two_nodes

S3_PORT = 29412
KEYS = {"AWS_ACCESS_KEY_ID": "chaos-key", "AWS_SECRET_ACCESS_KEY": "chaos-secret",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
MOTO = ("import logging, sys, time; from moto.server import ThreadedMotoServer; "
        "logging.getLogger('werkzeug').setLevel(logging.ERROR); "
        "s = ThreadedMotoServer(ip_address=sys.argv[1], port=int(sys.argv[2]), verbose=False); "
        "s.start(); print('ready', flush=True); time.sleep(3600)")
UPLOAD = ("import sys, boto3; from tools.remote_servers import upload; "
          "boto3.client('s3').create_bucket(Bucket='chaos'); upload(__import__('pathlib')."
          "Path(sys.argv[1]), 's3://chaos/set')")


def _stop_after(step: int, copy: Path) -> Callable[[list[subprocess.Popen]], None]:
    """SIGTERM to every process of both nodes once ``step`` is in node 0's ``copy`` of
    metrics.jsonl (a scheduler preempting the job)."""
    def stop(procs: list[subprocess.Popen]) -> None:
        wait_for_step(copy, step, procs[0])
        for proc in procs:
            signal_job(proc, signal.SIGTERM)
    return stop


def store_two_node_case(data: Path, work: Path) -> tuple[str, bool]:
    url = "s3://chaos/run"
    tmps = [work / f"node{i}-disk" for i in range(2)]
    for tmp in tmps:
        tmp.mkdir(parents=True, exist_ok=True)
    try:
        with two_nodes() as nodes:
            env = {**KEYS, "AWS_ENDPOINT_URL": f"http://{nodes.master}:{S3_PORT}"}
            server = start_on_node(nodes, 0, [sys.executable, "-c", MOTO, nodes.master,
                                              str(S3_PORT)], **env)
            try:
                if server.stdout.readline().strip() != "ready":
                    return f"moto did not start: {server.communicate()[0][-300:]}", False
                threading.Thread(target=server.stdout.read, daemon=True).start()  # drained
                upload = start_on_node(nodes, 0, [sys.executable, "-c", UPLOAD, str(data)],
                                       **env)
                if upload.wait(timeout=120) != 0:
                    return f"upload failed: {upload.communicate()[0][-300:]}", False
                copy = staging_dir(url, tmpdir=tmps[0])  # node 0's copy of the run folder
                job = functools.partial(train_on_nodes, nodes, "s3://chaos/set", copy,
                                        output=url, env=lambda rank: {**env,
                                                                      "TMPDIR": str(tmps[rank])})
                cut = job(during=_stop_after(3, copy))
                again = job()
            finally:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        one = train(data, work / "one", ranks=2)
    except NoNamespaces as err:
        return f"skipped: {err}", True
    said = "stopped by SIGTERM after step "
    saved = all(r.rc == 0 for r in cut) and said in cut[0].out
    resumed = all(r.rc == 0 for r in again) and f"resumed from {url}/checkpoints/" in again[0].out
    rows = [again[0].records(), one.records()]
    last = [r[-1] if r else {} for r in rows]
    same = last[0].get("step") == last[1].get("step") == STEPS and \
        abs(last[0]["loss"] - last[1]["loss"]) <= 1e-5 * abs(last[1]["loss"])
    steps = [r["step"] for r in rows[0] if "loss" in r]
    return (f"SIGTERM: rc {[r.rc for r in cut]}, saved {saved}; rerun rc "
            f"{[r.rc for r in again]}, resumed {resumed}, steps {steps}; loss at step {STEPS}: "
            f"{last[0].get('loss')} vs 1 node {last[1].get('loss')}"), \
        saved and resumed and same and steps == list(range(1, STEPS + 1))
