"""``launch.rendezvous``: the c10d rendezvous settings ``python -m launch.torchrun`` makes for
an elastic launch, each only where the user gave none (the two-node run that needs them is
``make chaos``'s elastic row)."""

from __future__ import annotations

import psutil
import pytest
from torch.distributed.run import get_args_parser

from launch.rendezvous import ENVIRONMENT, complete
from trainer.preemption import ELASTIC_ENV

TRAIN = ["-m", "launch.train", "--config", "configs/smoke.yaml"]


def _args(*options: str):
    return get_args_parser().parse_args([*options, *TRAIN])


def test_static_and_standalone_launches_are_left_as_given():
    for options in (["--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1"],
                    ["--standalone", "--nproc_per_node", "2"]):
        args, environ = _args(*options), {}
        before = vars(args).copy()
        assert complete(args, environ, hostname="localhost") is None
        assert vars(args) == before and environ == {}


def test_an_elastic_node_whose_name_is_loopback_gets_its_address_and_a_store_per_round():
    args, environ = _args("--nnodes", "1:2", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", "127.0.0.1:29400"), {}
    note = complete(args, environ, hostname="localhost")
    assert args.local_addr == "127.0.0.1"  # the address it reaches the endpoint from
    assert "is_host" not in args.rdzv_conf  # a loopback endpoint: torchrun's own choice
    assert environ == {**ENVIRONMENT, ELASTIC_ENV: "1:2"}
    assert "elastic, 1 to 2 nodes" in note and "--local-addr 127.0.0.1" in note


def test_what_the_user_set_is_kept():
    args = _args("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1",
                 "--rdzv-conf", "is_host=0,last_call_timeout=5", "--local-addr", "10.9.9.9")
    environ = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}
    complete(args, environ, hostname="localhost")
    assert (args.rdzv_conf, args.local_addr) == ("is_host=0,last_call_timeout=5", "10.9.9.9")
    assert environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"
    assert ELASTIC_ENV not in environ  # a fixed node count is not elastic


def test_the_node_holding_the_endpoint_address_hosts_the_store():
    mine = [a.address for addresses in psutil.net_if_addrs().values() for a in addresses
            if a.family.name == "AF_INET" and not a.address.startswith("127.")]
    if not mine:
        pytest.skip("no non-loopback IPv4 address on this machine")
    args = _args("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                 f"{mine[0]}:29400", "--rdzv-conf", "last_call_timeout=5")
    assert "hosts the rendezvous store" in complete(args, {}, hostname="localhost")
    assert args.rdzv_conf == "last_call_timeout=5,is_host=1"
    other = _args("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                  "192.0.2.1:29400")  # TEST-NET-1: no interface here holds it
    complete(other, {}, hostname="not-loopback.invalid")
    assert other.rdzv_conf == "" and other.local_addr is None
