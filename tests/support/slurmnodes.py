"""A private Slurm whose two compute nodes are network namespaces on this host.

    with slurmnodes.cluster(root) as slurm:   # nodes dln1, dln2; partition debug
        ...

The namespaces come from tests/support/fednet.py (a bridge in a namespace of its own, one veth per
node: dln1 = 10.77.0.1, dln2 = 10.77.0.2). The host gets one veth of its own on that bridge
(10.77.0.254, the only interface this adds to the root namespace) so that slurmctld, the daemon
under test and its `sbatch`/`squeue` reach the nodes, and the nodes reach slurmctld. Each
slurmd runs inside its node's namespace under `unshare --uts` with its own hostname, on the same
port as the other (each in its own namespace), `NodeAddr` its bridge address. munge is reached
through its filesystem socket (Unix sockets cross network namespaces), and so is the daemon's
socket a trial reports over. Everything (processes, namespaces, the host's veth) is removed
on the way out, failed or not.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import fednet, slurmkit

NODES = ("dln1", "dln2")
HOST_ADDR = f"{fednet.SUBNET}.254"


@dataclass
class Nodes(slurmkit.Slurm):
    """The running Slurm and its nodes' network namespaces (in the order of NODES)."""

    namespaces: list[str] = field(default_factory=list)

    def node_processes(self) -> dict[str, list[str]]:
        """node -> the command lines of what runs in its namespace besides slurmd itself."""
        found: dict[str, list[str]] = {}
        for name, ns in zip(NODES, self.namespaces, strict=True):
            pids = fednet.ip("netns", "pids", ns, check=False).stdout.split()
            cmds = []
            for pid in pids:
                try:
                    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                argv = raw.decode(errors="replace").split("\0")
                if argv[0] and Path(argv[0]).name != "slurmd":
                    cmds.append(" ".join(argv).strip())
            found[name] = cmds
        return found


def _config(root: Path, partition: str) -> str:
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={name} NodeAddr={fednet.SUBNET}.{i} CPUs=4 "
        "RealMemory=2000 State=UNKNOWN"
        for i, name in enumerate(NODES, start=1)
    )
    return slurmkit.conf_text(
        root,
        f"detlocaln{os.getpid()}",
        f"{socket.gethostname()}({HOST_ADDR})",
        nodes,
        f"PartitionName={partition} Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
    )


def _host_link(net: fednet.Net) -> str:
    """The host's veth on the bridge (its peer `vh` in the bridge's namespace)."""
    name = f"{net.prefix}-h"
    fednet.ip("link", "add", name, "type", "veth", "peer", "name", "vh", "netns", net.sw)
    fednet.ip("-n", net.sw, "link", "set", "vh", "master", "br0", "up")
    fednet.ip("addr", "add", f"{HOST_ADDR}/24", "dev", name)
    fednet.ip("link", "set", name, "up")
    return name


def _slurmd(ns: str, name: str, conf: Path, hide: tuple[Path, ...] = ()) -> list[str]:
    """slurmd in the node's namespace with its own hostname (a UTS namespace of its own).
    `nsenter --net`, not `ip netns exec`: that one mounts a fresh /sys without the cgroup
    tree slurmd 22.05 opens at start ("No filesystem mounted on /sys/fs/cgroup"). ``hide``:
    directories the node and its jobs do not see (a mount namespace of its own, an empty tmpfs
    over each, as tests/support/slurmkit.py hides them): a node without the daemon's files."""
    mounts = "".join(
        f"mount -t tmpfs -o size=1m,mode=755 hidden {shlex.quote(str(p))} && " for p in hide
    )
    return [
        "nsenter", f"--net=/run/netns/{ns}", "--",
        "unshare", "--uts", "--mount", "--propagation", "private", "--",
        "sh", "-c", mounts + 'hostname "$1" && exec "$2" -D -N "$1" -f "$3"', "slurmd",
        name, slurmkit._sbin("slurmd"), str(conf),
    ]  # fmt: skip


def _prepare(root: Path) -> None:
    """Directories, and a fresh munge key, as tests/support/slurmkit.py makes them."""
    for old in root.glob("slurm*.log"):
        old.unlink()
    for d in ("munge", "munge-key", "munge-key/log", "state", *(f"spool/{n}" for n in NODES)):
        (root / d).mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    (root / "munge").chmod(0o755)  # every user's sbatch reaches munge's socket
    (root / "munge-key").chmod(0o700)  # the key stays root's
    key = root / "munge-key" / "munge.key"
    key.unlink(missing_ok=True)
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)


def _launch(slurm: Nodes, slurmds: list[list[str]]) -> None:
    """munged, `slurmctld -D` on the host, each node's slurmd; returns once every node is idle
    (bounded). Stops what it started when anything fails."""
    root, env = slurm.root, {**os.environ, **slurm.env}
    try:
        subprocess.run(
            [
                slurmkit._sbin("munged"),
                f"--socket={root}/munge/munge.socket",
                f"--key-file={root}/munge-key/munge.key",
                f"--pid-file={root}/munge-key/munged.pid",
                f"--log-file={root}/munge-key/log/munged.log",
                f"--seed-file={root}/munge-key/munged.seed",
                "--force",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        ctld = [slurmkit._sbin("slurmctld"), "-D", "-i", "-f", str(slurm.conf)]
        for i, argv in enumerate([ctld, *slurmds]):
            with open(root / f"daemon{i}.stderr", "wb") as err:
                slurm.procs.append(
                    subprocess.Popen(
                        argv,
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        start_new_session=True,
                    )  # fmt: skip
                )
        deadline = time.monotonic() + slurmkit.START_TIMEOUT_S
        delay = 0.05
        while not all_idle(slurm):
            died = any(p.poll() is not None for p in slurm.procs)
            if died and "Address already in use" in slurm.logs():
                raise slurmkit.PortTaken(slurm.logs())
            if died or time.monotonic() > deadline:
                raise RuntimeError(
                    f"Slurm did not come up ({slurm.node_state()!r})\n{slurm.logs()}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
    except BaseException:
        slurmkit.stop(slurm)
        raise


def all_idle(slurm: slurmkit.Slurm) -> bool:
    states = slurm.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
    return sorted(states[0::2]) == sorted(NODES) and set(states[1::2]) == {"idle"}


@contextlib.contextmanager
def cluster(root: Path, partition: str = "debug", hide: tuple[Path, ...] = ()) -> Iterator[Nodes]:
    """Two namespaced compute nodes and a controller on the host; all idle on entry.
    ``hide``: see _slurmd."""
    fednet.sweep()
    with fednet.Net(root / "net") as net:
        link = _host_link(net)
        try:
            for i in range(1, len(NODES) + 1):
                net.node(i)
            conf = root / "slurm.conf"
            slurm = Nodes(root, conf, partition, NODES[0], [], [n.ns for n in net.nodes])
            for attempt in range(3):  # again on new ports when one was taken meanwhile
                _prepare(root)
                conf.write_text(_config(root, partition))
                daemons = [
                    _slurmd(node.ns, n, conf, hide)
                    for node, n in zip(net.nodes, NODES, strict=True)
                ]
                slurm.procs.clear()
                try:
                    _launch(slurm, daemons)
                    break
                except slurmkit.PortTaken:
                    if attempt == 2:
                        raise
            try:
                yield slurm
            finally:
                slurmkit.stop(slurm)
        finally:
            fednet.ip("link", "del", link, check=False)


def skip_reason() -> str | None:
    missing = slurmkit.missing_tools() + [t for t in ("ip", "unshare") if not shutil.which(t)]
    if missing:
        return f"Slurm or iproute2 missing ({', '.join(missing)}): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "a Slurm of network namespaces needs root"
    return None
