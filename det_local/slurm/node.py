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
  nodes' network (or nothing: it falls back to loopback and the ranks never meet).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping

from det_local.sched.run.rendezvous import (
    CHIEF_ENV,
    IFNAME_VARS,
    NNODES_ENV,
    NODE_RANK_ENV,
    interface_of,
)

USAGE = "usage: python3 -m det_local.slurm.node -- CMD..."


def chief(environ: Mapping[str, str]) -> str:
    addr = environ.get("SLURM_LAUNCH_NODE_IPADDR", "").strip()
    if addr:
        return addr
    nodelist = environ.get("SLURM_JOB_NODELIST", "")
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    return out[0] if out else socket.gethostname()


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
    head = chief(environ)
    env = {
        CHIEF_ENV: head,
        NNODES_ENV: environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES") or "1",
        NODE_RANK_ENV: environ.get("SLURM_NODEID", "0"),
        "DET_AGENT_ID": socket.gethostname(),
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
