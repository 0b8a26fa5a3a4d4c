"""Run a function on N spawned gloo CPU ranks and collect the results in the parent.

Usage (the function must be importable, i.e. defined at module level of a test module or
helper, and its arguments and result picklable)::

    from spawn import run_ranks

    def _work(rank, world_size, n):          # runs inside an initialised gloo group
        ...
        return {"loss": 1.0}                 # any picklable value (tensors: use .clone())

    results = run_ranks(_work, world_size=3, args=(5,))   # list, results[rank]

Each run binds a fresh free port (so tests can run in parallel under ``pytest -n``), limits
each worker to one intra-op thread (the CI machine has 2 cores), and ends every worker with
``destroy_process_group()`` then ``os._exit(0)`` (gloo otherwise aborts at interpreter exit in
a few percent of runs). A worker's exception is re-raised in the parent with its traceback.

Ranks are forked from multiprocessing's fork server, one per test process, which imports
torch and the project once (:data:`PRELOAD`): a spawned rank paid 1.2-2.5 CPU-s importing
them, and the suite starts ~130 ranks (the files that use this helper: 3 min 57 s spawned,
2 min 50 s forked, on 2 workers). The server only imports (no threads, no tensors, no
process group), so each rank starts from that clean state; it gets the calling test's
environment (a test's private cache folders, ``monkeypatch.setenv``) and working folder, not
the server's. DeepSpeed is left out: it picks its accelerator at import.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp

__all__ = ["free_port", "run_ranks"]

# torch._dynamo: every torch.optim optimizer imports it at its first call (1.5 CPU-s a rank).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "pytest", "partial_fc",
           "data_pipeline", "trainer.config", "trainer.engine", "trainer.checkpoint", "spawn",
           "launch_helpers"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(fn, rank, world_size, port, args, environment, out_queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()  # the test's environment, not the fork server's
    os.environ.update(environment)
    torch.set_num_threads(1)
    status, payload = "ok", None
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        payload = fn(rank, world_size, *args)
        # Plain pickle stores tensors by value (multiprocessing's pickler would share their
        # memory, which dies with this process).
        payload = pickle.dumps(payload)
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        status, payload = "error", traceback.format_exc()
    out_queue.put((rank, status, payload))
    out_queue.close()
    out_queue.join_thread()  # flush before os._exit
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0)


def run_ranks(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
              timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when this process first starts the server
    out_queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, tuple(args),
                                          dict(os.environ), out_queue))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                rank, status, payload = out_queue.get(timeout=0.5)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    errors.append(f"a rank died with exit code {dead[0]} before reporting")
                elif time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout}s waiting for the ranks")
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:  # the other ranks may now block in a collective: stop them below
                errors.append(f"rank {rank} failed:\n{payload}")
    finally:
        for proc in procs:
            proc.join(timeout=5 if not errors else 1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[rank] for rank in range(world_size)]
