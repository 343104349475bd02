"""``python3 -m det_local.slurm.node -- CMD...``: what ``srun`` starts on each node of a trial
that spans several Slurm nodes, before the trial's own launcher (``CMD``: the plan's command,
``determined.launch.torch_distributed ...``).

It sets what det-local's launchers read on a node of a multi-node trial, from what Slurm
gives the step, then execs ``CMD``:

* ``DET_CHIEF_IP``: the allocation's first host, where the rendezvous listens. ``srun`` runs in
  the batch shell, on that host, so ``SLURM_LAUNCH_NODE_IPADDR`` is its address as the nodes
  reached it (a node's name need not resolve on the others); without it, the first name of
  ``SLURM_JOB_NODELIST``;
* ``DET_LOCAL_NNODES`` (``SLURM_NNODES``), ``DET_LOCAL_NODE_RANK`` (``SLURM_NODEID``: the first
  host is 0), ``DET_AGENT_ID`` (this node's hostname);
* ``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``, ``TP_SOCKET_IFNAME``: the interface this node
  reaches the chief on, unless already set (the experiment's ``environment_variables``). Left
  alone, gloo binds the address the hostname resolves to, which on many clusters is not the
  nodes' network (or nothing: it falls back to loopback and the ranks never meet);
* ``DET_LOCAL_NODE_INFO``: this node's part of ``get_cluster_info()`` (the run's info
  directory is one for all nodes): ``agent_id``, ``container_rank``, ``container_addrs``,
  ``container_slot_counts``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from det_local.sched.run.rendezvous import (
    CHIEF_ENV,
    IFNAME_VARS,
    NNODES_ENV,
    NODE_RANK_ENV,
    interface_of,
)
from det_local.wire.trialinfo import NODE_INFO_ENV

USAGE = "usage: python3 -m det_local.slurm.node -- CMD..."


def hostnames(environ: Mapping[str, str]) -> list[str]:
    """The allocation's nodes, first host first (`scontrol show hostnames` expands the list)."""
    nodelist = environ.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        return []
    try:
        return subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return []


def chief(environ: Mapping[str, str], hosts: list[str]) -> str:
    addr = environ.get("SLURM_LAUNCH_NODE_IPADDR", "").strip()
    if addr:
        return addr
    return hosts[0] if hosts else socket.gethostname()


def address(host: str) -> str:
    """A node's IPv4 address when its name resolves, else its name."""
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
    except (OSError, IndexError):
        return host


def node_info(environ: Mapping[str, str], hosts: list[str], head: str) -> dict[str, Any]:
    """This node's part of get_cluster_info() (DET_LOCAL_NODE_INFO, read by
    `wire/trialinfo.get_cluster_info`): its agent, its rank, every node's address (the chief's
    as the nodes reached it) and slots, as a local multi-machine trial has them."""
    nnodes = max(int(environ.get("SLURM_NNODES") or 1), 1)
    rank = int(environ.get("SLURM_NODEID") or 0)
    addrs = [head, *(address(h) for h in hosts[1:nnodes])]
    addrs += [f"node{i}" for i in range(len(addrs), nnodes)]  # a list Slurm did not give
    try:
        per_node = len(json.loads(environ.get("DET_SLOT_IDS") or "[0]"))
    except ValueError:
        per_node = 1
    return {
        "agent_id": socket.gethostname(),
        "container_addrs": addrs,
        "container_rank": rank,
        "container_slot_counts": [max(per_node, 1)] * nnodes,
    }


def route_interface(address: str) -> str | None:
    """This machine's interface toward ``address`` (the one holding it, when it is this
    machine's): the source address the kernel picks to reach it, then its interface."""
    try:
        infos = socket.getaddrinfo(address, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(sockaddr)  # UDP: no packet sent, only a route chosen
                source = str(probe.getsockname()[0])
        except OSError:
            continue
        name = interface_of(source)
        if name is not None:
            return name
    return None


def node_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables this node's launcher needs, from Slurm's step environment."""
    hosts = hostnames(environ)
    head = chief(environ, hosts)
    env = {
        CHIEF_ENV: head,
        NNODES_ENV: environ.get("SLURM_NNODES") or "1",
        NODE_RANK_ENV: environ.get("SLURM_NODEID", "0"),
        "DET_AGENT_ID": socket.gethostname(),
        NODE_INFO_ENV: json.dumps(node_info(environ, hosts, head)),
    }
    if not all(environ.get(name) for name in IFNAME_VARS):
        iface = route_interface(head)
        if iface is not None:
            env.update({name: iface for name in IFNAME_VARS if not environ.get(name)})
    return env


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(f"det-local: error: slurm.node: no command to run\n{USAGE}", file=sys.stderr)
        return 2
    env = {**os.environ, **node_env(os.environ)}
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as err:
        print(f"det-local: error: cannot run {argv[0]!r}: {err.strerror or err}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
