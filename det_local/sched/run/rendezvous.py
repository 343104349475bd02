"""Where the nodes of one multi-node trial meet: :class:`Rendezvous`, as Determined's
``RendezvousInfo`` plus what det-local's launchers need on each node.

A trial that runs on one machine has no Rendezvous (None): its plan, its environment and its
``rendezvous.json`` are what they always were (chief 127.0.0.1, one node). A trial whose ranks
run on several machines gets one Rendezvous per node, all alike but ``node_rank`` and
``ifname``; :func:`~det_local.sched.run.trialplan.build_trial_plan` turns it into the environment
the launchers read:

* ``DET_CHIEF_IP`` = ``addrs[0]`` (torchrun's ``--master_addr``, the in-trial hub's address);
* ``DET_LOCAL_NNODES``, ``DET_LOCAL_NODE_RANK`` (torchrun's ``--nnodes``, ``--node_rank``);
* ``DET_LOCAL_DIST_SECRET``: the in-trial hub's shared secret (the same on every node; each
  node's session token is its own);
* ``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``, ``TP_SOCKET_IFNAME`` = ``ifname``, the
  interface carrying this node's LAN address, unless the experiment's
  ``environment_variables`` set them.

The rendezvous ports (C10D_PORT, INTER_TRAIN_PROCESS_COMM_PORT_1/2) are the chief's, the same
on every node: the caller chooses them once and passes them in ``TrialFacts.ports``.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Collection
from dataclasses import dataclass

from det_local.errors import DetLocalError

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
NNODES_ENV = "DET_LOCAL_NNODES"
NODE_RANK_ENV = "DET_LOCAL_NODE_RANK"
CHIEF_ENV = "DET_CHIEF_IP"
SECRET_ENV = "DET_LOCAL_DIST_SECRET"  # the in-trial hub's (trial/core/_hub.py reads it)
#: the ports every node of a multi-node trial must share (the chief's)
SHARED_PORTS = ("C10D_PORT", "INTER_TRAIN_PROCESS_COMM_PORT_1", "INTER_TRAIN_PROCESS_COMM_PORT_2")


class RendezvousError(DetLocalError):
    """A rendezvous description that no launch could follow (a bug in its maker)."""


@dataclass(frozen=True)
class Rendezvous:
    """One node's view of a multi-node trial."""

    addrs: list[str]  # every node's LAN address, the chief first
    node_rank: int  # this node's index in addrs
    slot_counts: list[int]  # the slots of each node, in the order of addrs
    ifname: str | None  # this node's interface carrying its LAN address (None: let torch pick)
    dist_secret: str  # hex: the in-trial hub's shared secret

    def __post_init__(self) -> None:
        where = f"rendezvous (node_rank {self.node_rank}, addrs {self.addrs})"
        if not self.addrs or not all(isinstance(a, str) and a for a in self.addrs):
            raise RendezvousError(f"{where}: addrs must be one non-empty address per node")
        if len(self.slot_counts) != len(self.addrs):
            raise RendezvousError(
                f"{where}: {len(self.slot_counts)} slot counts for {len(self.addrs)} nodes; "
                "give one per node"
            )
        if not all(isinstance(n, int) and n >= 1 for n in self.slot_counts):
            raise RendezvousError(f"{where}: slot_counts {self.slot_counts} must all be >= 1")
        if not 0 <= self.node_rank < len(self.addrs):
            raise RendezvousError(f"{where}: node_rank must be in 0..{len(self.addrs) - 1}")
        try:
            secret = bytes.fromhex(self.dist_secret)
        except (TypeError, ValueError):
            secret = b""
        if not secret:
            raise RendezvousError(f"{where}: dist_secret must be a non-empty hex string")

    @property
    def nnodes(self) -> int:
        return len(self.addrs)

    @property
    def chief(self) -> str:
        return self.addrs[0]

    def to_env(self, configured: Collection[str] = ()) -> dict[str, str]:
        """The variables the launchers read on this node. ``configured``: the names the
        experiment's environment_variables set (an interface variable among them is kept)."""
        env = {
            CHIEF_ENV: self.chief,
            NNODES_ENV: str(self.nnodes),
            NODE_RANK_ENV: str(self.node_rank),
            SECRET_ENV: self.dist_secret,
        }
        if self.ifname:
            env.update({name: self.ifname for name in IFNAME_VARS if name not in configured})
        return env


def interface_of(address: str) -> str | None:
    """The name of this machine's interface that holds ``address`` (an IPv4 or IPv6 address),
    or None when none does (or it is not an address)."""
    import psutil

    try:
        wanted = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(a.address.partition("%")[0]) == wanted:
                    return name
            except ValueError:
                continue
    return None
