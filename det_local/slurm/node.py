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

It then runs ``CMD`` as its child (signals forwarded) and, when it has ended, writes this node's
exit into the run's info directory (`slurm/rankexit.py`: the first failing process rank its
launcher named, whether srun stopped the node): with several nodes the job's own status is
srun's, often the node srun stopped, not the one that failed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from det_local.launch.wrap_rank import FIRST_FAILURE_ENV
from det_local.sched.run.rendezvous import (
    CHIEF_ENV,
    IFNAME_VARS,
    NNODES_ENV,
    NODE_RANK_ENV,
    interface_of,
)
from det_local.slurm import rankexit
from det_local.wire.trialinfo import NODE_INFO_ENV

USAGE = "usage: python3 -m det_local.slurm.node -- CMD..."
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # srun stopping the step


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
    info_dir, slurm_id = os.environ.get("DET_LOCAL_INFO_DIR"), os.environ.get("SLURM_JOB_ID")
    if not info_dir or not slurm_id:  # nowhere to say how it ended: the command itself
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as err:
            return _cannot_run(argv[0], err)
    return run_and_record(argv, env, info_dir or "", slurm_id or "")


def _cannot_run(command: str, err: OSError) -> int:
    print(f"det-local: error: cannot run {command!r}: {err.strerror or err}", file=sys.stderr)
    return 127


def run_and_record(argv: list[str], env: dict[str, str], info_dir: str, slurm_id: str) -> int:
    """Run the node's launcher, forwarding signals to it, then write this node's exit
    (`slurm/rankexit.py`): the batch shell and the daemon name the node that failed first."""
    scratch = tempfile.mkdtemp(prefix="det-local-node-")  # the launcher's first failing rank
    failure = os.path.join(scratch, "first-failure")
    env[FIRST_FAILURE_ENV] = failure
    stopped: list[float] = []  # when srun (or scancel) first told the step to stop

    child: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: object) -> None:
        if signum in STOPPING and not stopped:
            stopped.append(time.time())
        for proc in child:
            try:
                proc.send_signal(signum)
            except OSError:
                pass

    for signum in FORWARDED:  # before the start: a stop that comes meanwhile is seen
        signal.signal(signum, forward)
    try:
        child.append(subprocess.Popen(argv, env=env))
    except OSError as err:
        shutil.rmtree(scratch, ignore_errors=True)
        code = _cannot_run(argv[0], err)
        _record(info_dir, slurm_id, code, None, time.time(), bool(stopped))
        return code
    returncode = child[0].wait()
    ended = time.time()
    code = 128 - returncode if returncode < 0 else returncode
    rank, status, at = _first_failure(failure)
    shutil.rmtree(scratch, ignore_errors=True)
    # stopped: told to stop before a rank of its own failed (a failure of its own that came
    # first is its own, and so is its code, whatever the launcher exited with once stopped)
    was_stopped = bool(stopped) and (at is None or stopped[0] <= at)
    if at is not None and status and not was_stopped:
        code = status
    _record(info_dir, slurm_id, code, rank, at or ended, was_stopped)
    return code


def _first_failure(path: str) -> tuple[int | None, int | None, float | None]:
    """What the node's launcher's supervisor wrote (`launch/supervise.py`): the first failing
    rank, its exit status and when; Nones when nothing failed there."""
    try:
        with open(path) as f:
            words = f.read(256).split()
        rank = int(words[0]) if words[0] != "-" else None
        return rank, int(words[1]), float(words[2])
    except (OSError, ValueError, IndexError):
        return None, None, None


def _record(
    info_dir: str, slurm_id: str, code: int, rank: int | None, at: float, stopped: bool
) -> None:
    record = rankexit.NodeExit(
        node=socket.gethostname(),
        node_rank=int(os.environ.get("SLURM_NODEID") or 0),
        code=code,
        rank=rank,
        stopped=stopped,
        at=at,
    )
    rankexit.write(info_dir, slurm_id, record)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
