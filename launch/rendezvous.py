"""The c10d rendezvous settings ``python -m launch.torchrun`` completes before torchrun starts,
so that an elastic launch (``--nnodes MIN:MAX --rdzv-backend c10d --rdzv-endpoint HOST:PORT
--max-restarts K``) survives a node that leaves and one that joins (docs/cluster.md, "Elastic
runs"). Each one is set only where the user gave none; plain torchrun (torch 2.13, measured
on two network namespaces) needs all of them:

- **the store's host** (``--rdzv-conf is_host=1``): torchrun hosts the rendezvous store on
  the node whose *host name* resolves to the endpoint; where the names resolve to loopback
  (a common ``/etc/hosts`` line) no node hosts it and every node waits for the join timeout.
  Here the node that holds the endpoint's address on one of its interfaces hosts it.
- **this node's address** (``--local-addr``): the rank-0 node tells the others its FQDN as
  the workers' ``MASTER_ADDR``; a name that resolves to loopback sends every other node's
  workers to their own loopback. Here, when the name resolves to loopback, the address this
  node reaches the endpoint from.
- **a store per incarnation** (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): by default the
  workers share the agent's store and tell incarnations apart by
  ``TORCHELASTIC_RESTART_COUNT``, which each node counts for itself: after a node left and
  one joined, the survivor's count was 1 and the newcomer's 0, and their workers waited for
  each other under different keys until the process group's timeout (measured; torch's issue
  135712). Also, as torch 2.13's ``DynamicRendezvousHandler.next_rendezvous`` reads, the
  rank-0 node publishes the shared store's address in its first round only, which a node
  joining later waits for. With the setting each round's rank-0 worker starts a fresh store.
- **ranks without the agents' exchange** (``TORCH_ELASTIC_WORKER_IDENTICAL=1``): otherwise
  the rank-0 agent reads every node's role from the store; a round that still counts a node
  that has just died (its heartbeat not yet expired) then waits 60 s for that node and ends
  the surviving agent itself (rc 1), restarts left or not (seen in an earlier try on two
  namespaces; an exception in the agent's rendezvous is not retried). With the setting the
  ranks are ``node rank x nproc_per_node + local rank`` (every node runs the same number), and a
  dead member only fails the workers' first collective, which the agent restarts.

With ``MIN < MAX`` the ranks are also told the launch is elastic (:data:`ELASTIC_ENV`): a
rank whose launcher dies then ends at once, as on a node that is lost, and the other nodes
restart without it from the last checkpoint, instead of the whole job saving and stopping
(``trainer.preemption.LauncherWatch``).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import MutableMapping

from trainer.dist import interface_of, is_loopback, route_source
from trainer.preemption import ELASTIC_ENV

DEFAULT_PORT = 29400  # torchrun's for a c10d endpoint without one
ENVIRONMENT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCH_ELASTIC_WORKER_IDENTICAL": "1"}


def hosts_endpoint(host: str) -> bool:
    """Whether this machine holds one of ``host``'s non-loopback addresses on an interface
    (a loopback endpoint is left to torchrun, which hosts it on the first node to try)."""
    try:
        found = {info[4][0].split("%")[0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return False
    return any(not ipaddress.ip_address(a).is_loopback and interface_of(a) for a in found)


def complete(args, environ: MutableMapping[str, str] = os.environ,
             hostname: str | None = None) -> str | None:
    """Fill in ``args`` (torchrun's parsed arguments) and ``environ`` (what the agent and its
    workers inherit) for a c10d rendezvous, where the user set nothing else; None for
    another launch (``--standalone``, static). Returns one line saying what was chosen.
    ``hostname``: this node's name (``socket.gethostname()`` when None)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone or args.rdzv_backend != "c10d":
        return None
    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=DEFAULT_PORT)
    given = {item.split("=", 1)[0].strip() for item in args.rdzv_conf.split(",")}
    chosen = []
    if "is_host" not in given and hosts_endpoint(host):
        args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, "is_host=1"]))
        chosen.append("hosts the rendezvous store")
    if args.local_addr is None and is_loopback(hostname or socket.gethostname()):
        try:
            args.local_addr = route_source(host, port)
            chosen.append(f"--local-addr {args.local_addr} (its name resolves to loopback)")
        except OSError:  # unresolvable yet (a service coming up): torchrun says so itself
            pass
    for name, value in ENVIRONMENT.items():
        environ.setdefault(name, value)
    low, high = parse_min_max_nnodes(args.nnodes)
    if low < high:
        environ[ELASTIC_ENV] = f"{low}:{high}"
    how = f"elastic, {low} to {high} nodes" if low < high else f"{low} nodes"
    return (f"launch.torchrun: c10d rendezvous at {host}:{port} ({how}); this node "
            + (", ".join(chosen) if chosen else "as given"))
