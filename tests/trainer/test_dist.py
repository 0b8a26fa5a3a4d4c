"""trainer/dist.py: the process group's one timeout, on every group."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from spawn import free_port, run_ranks

TIMEOUT_S = 3.0  # dist.timeout_s of the group under test
# How late rank 1 comes to the set-up, as a loaded machine makes it (importing DeepSpeed takes
# seconds, and more under load): longer than the timeout, so that a set-up the timeout bounds
# fails here every time instead of once under load.
LATE_S = TIMEOUT_S + 2.0


def _late_peer_on_deepspeeds_group(rank: int, world: int, port: int) -> str:
    """``init_distributed`` with a :data:`TIMEOUT_S` timeout, then an all-reduce on
    DeepSpeed's data-parallel group (the one ZeRO reduces gradients on) that rank 1 never
    joins; returns rank 0's outcome.

    The timeout bounds every rendezvous after ``init_distributed``, the group's creation
    included; what those wait for must be the peer's few milliseconds of work (10 ms from
    the barrier to DeepSpeed's group, measured idle), not its imports. So each rank does its
    slow part first (the imports; rank 1 also sleeps :data:`LATE_S`), and both leave it
    through a barrier on ``run_ranks``' group (torch's 30-min default) before the group
    under test exists."""
    import time

    import torch
    import torch.distributed as dist

    from trainer.dist import init_distributed
    from trainer.engine.deepspeed_backend import import_deepspeed

    deepspeed = import_deepspeed(torch.device("cpu"))
    from deepspeed import ops
    from deepspeed.utils import groups

    ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as engine.cpu_shm_comm=false
    if rank == 1:
        time.sleep(LATE_S)
    dist.barrier()
    dist.destroy_process_group()  # run_ranks' group: start ours the way launch.train does
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    init_distributed("cpu", TIMEOUT_S)
    deepspeed.init_distributed(dist_init_required=False)
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
    30 min gloo default and this test runs into run_ranks' limit instead. Rank 1 comes to
    the set-up :data:`LATE_S` late on every run, as under load."""
    outcome, _ = run_ranks(_late_peer_on_deepspeeds_group, 2, args=(free_port(),), timeout=90)
    assert "Timed out" in outcome and f"{TIMEOUT_S * 1000:.0f}ms" in outcome, outcome


# ----------------------------------------------------------------------------- interface

NODE1 = {"MASTER_ADDR": "10.7.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2",
         "LOCAL_WORLD_SIZE": "1"}
LOOPBACK = {"localhost", "127.0.0.1", "node1", "node0"}  # node0/node1 name themselves 127.0.x.1


def _pick(environ, hostname="node1", backend="gloo", routes=None, interfaces=None):
    """:func:`socket_interface` on faked look-ups: ``routes`` master -> source address,
    ``interfaces`` address -> interface name."""
    from trainer.dist import socket_interface

    routes = {"10.7.0.1": "10.7.0.2"} if routes is None else routes
    interfaces = {"10.7.0.2": "veth1", "127.0.0.1": "lo"} if interfaces is None else interfaces

    def source(host, port):
        if host not in routes:
            raise OSError(101, "Network is unreachable")
        return routes[host]

    return socket_interface(backend, environ, hostname, loopback=LOOPBACK.__contains__,
                            source=source, interface=interfaces.get)


def test_loopback_hostname_on_a_second_node_gets_the_interface_routing_to_master():
    assert _pick(NODE1) == "veth1"
    assert _pick(NODE1, backend="nccl") == "veth1"


@pytest.mark.parametrize("change", [
    {"GLOO_SOCKET_IFNAME": "eth0"},  # the user chose
    {"NCCL_SOCKET_IFNAME": "ib0"},
    {"LOCAL_WORLD_SIZE": "2"},  # one node: loopback is right
    {"MASTER_ADDR": "localhost"},  # several nodes, all on this host: loopback is right
    {"MASTER_ADDR": "127.0.0.1"},
    {"MASTER_ADDR": None},  # no torchrun
])
def test_nothing_to_pick(change):
    environ = {k: v for k, v in {**NODE1, **change}.items() if v is not None}
    assert _pick(environ) is None


def test_a_hostname_that_resolves_to_the_network_is_left_to_gloo():
    assert _pick(NODE1, hostname="node1.cluster") is None


def test_without_torchrun_a_loopback_master_means_one_node():
    environ = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2"}
    assert _pick(environ) is None
    assert _pick({**environ, "MASTER_ADDR": "10.7.0.1"}) == "veth1"


@pytest.mark.parametrize(("master", "backend", "words"), [
    ("node0", "gloo", "routes to MASTER_ADDR=node0"),  # node 0 names itself as the master
    ("10.9.9.9", "nccl", "MASTER_ADDR=10.9.9.9 is unreachable"),
])
def test_no_interface_to_master_is_refused_naming_the_variable(master, backend, words):
    from trainer.config.schema import ConfigError

    with pytest.raises(ConfigError) as err:
        _pick({**NODE1, "MASTER_ADDR": master}, backend=backend,
              routes={"node0": "127.0.0.1"})
    message = str(err.value)
    assert words in message and f"set {backend.upper()}_SOCKET_IFNAME" in message
    assert "\n" not in message


def test_the_real_lookups_on_this_host():
    """The OS seams themselves: loopback names, the route to 127.0.0.1 leaves from lo."""
    from trainer.dist import interface_of, is_loopback, route_source

    assert is_loopback("localhost") and is_loopback("127.0.0.1") and not is_loopback("10.7.0.1")
    assert route_source("127.0.0.1", 9) == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo" and interface_of("192.0.2.77") is None
