"""trainer/dist.py: the process group's one timeout, on every group."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from spawn import free_port, run_ranks


def _late_peer_on_deepspeeds_group(rank: int, world: int, port: int) -> str:
    """``init_distributed`` with a 3 s timeout, then an all-reduce on DeepSpeed's
    data-parallel group (the one ZeRO reduces gradients on) that rank 1 never joins."""
    import torch
    import torch.distributed as dist

    from trainer.dist import init_distributed
    from trainer.engine.deepspeed_backend import import_deepspeed

    dist.destroy_process_group()  # run_ranks' group: start ours the way launch.train does
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    init_distributed("cpu", 3.0)
    deepspeed = import_deepspeed(torch.device("cpu"))
    from deepspeed import ops

    ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as engine.cpu_shm_comm=false
    deepspeed.init_distributed(dist_init_required=False)
    from deepspeed.utils import groups

    group = groups._get_data_parallel_group()  # created here, by DeepSpeed, without a timeout
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # alive but silent until rank 0 has given up
        store.wait(["rank0-done"], timedelta(seconds=100))
        return "waited"
    try:
        dist.all_reduce(torch.ones(4), group=group)
        outcome = "completed"
    except RuntimeError as err:
        outcome = str(err).splitlines()[0]
    store.set("rank0-done", "1")
    return outcome


@pytest.mark.slow
def test_deepspeeds_own_group_times_out_with_dist_timeout():
    """Without :func:`trainer.dist.default_group_timeout` DeepSpeed's group waits torch's
    30 min gloo default and this test runs into run_ranks' limit instead."""
    outcome, _ = run_ranks(_late_peer_on_deepspeeds_group, 2, args=(free_port(),), timeout=90)
    assert "Timed out" in outcome and "3000ms" in outcome, outcome
