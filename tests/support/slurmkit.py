"""A private single-host Slurm for the Slurm pool tests: munged, slurmctld and slurmd on a
per-run configuration, ports and spool directories, started and stopped by a fixture.

Debian's `slurm-wlm` and `munge` (installed by `.ci/run`). Without them the Slurm tests are
skipped with the reason. ``SLURM_CONF`` reaches `sbatch`/`squeue` only through the environment of
whoever runs them (a test's daemon gets it in its own environment; trials never see it unless a
job carries it).
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")
START_TIMEOUT_S = 60.0


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]


def _free_ports(n: int) -> list[int]:
    """n distinct free TCP ports (held open together while chosen, so never the same one)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Slurm:
    """A running private Slurm: its config file and the environment its clients need."""

    root: Path
    conf: Path
    partition: str
    node: str
    procs: list[subprocess.Popen[bytes]]

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv),
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=30,
            check=check,
        )

    def queue(self) -> list[str]:
        """Job ids Slurm still has pending or running."""
        out = self.run("squeue", "-h", "-o", "%i %T").stdout
        return [line.split()[0] for line in out.splitlines() if line.strip()]

    def node_state(self) -> str:
        out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout
        return out.strip()

    def logs(self) -> str:
        parts = []
        for p in sorted(self.root.glob("slurm*.log")):  # slurmctld, each node's slurmd
            parts.append(f"--- {p.name}\n" + p.read_text(errors="replace")[-4000:])
        return "\n".join(parts)


def conf_text(root: Path, cluster: str, ctld_host: str, nodes: str, partition_line: str) -> str:
    """A private Slurm's slurm.conf: its files under ``root``, its own munge socket, free ports,
    no accounting, scheduling at once; ``nodes`` and ``partition_line`` say what it runs on."""
    ctld, slurmd = _free_ports(2)
    return f"""ClusterName={cluster}
SlurmctldHost={ctld_host}
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
SlurmdParameters=config_overrides
KillWait=5
MinJobAge=300
InactiveLimit=0
Waittime=0
{nodes}
{partition_line}
"""


def _config(root: Path, node: str, partition: str) -> str:
    host = socket.gethostname()
    return conf_text(
        root,
        f"detlocal{os.getpid()}",
        f"{host}(127.0.0.1)",
        f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 CPUs=8 RealMemory=4000 "
        "State=UNKNOWN",
        f"PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=NO",
    )


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def start(
    root: Path, *, node: str = "n1", partition: str = "debug", hide: tuple[Path, ...] = ()
) -> Slurm:
    """munged (a private key and socket), then slurmctld -D and slurmd -D; returns once the
    node is idle (bounded). Tried again on new ports when a port was taken meanwhile.
    ``hide``: directories slurmd and its jobs do not see (slurmd in a mount namespace of its
    own, an empty tmpfs over each): a compute node that is not this host."""
    for attempt in range(3):
        try:
            return _start(root, node, partition, hide)
        except PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class PortTaken(RuntimeError):
    pass


def _hidden(argv: list[str], hide: tuple[Path, ...]) -> list[str]:
    if not hide:
        return argv
    mounts = " && ".join(
        f"mount -t tmpfs -o size=1m,mode=755 hidden {shlex.quote(str(p))}" for p in hide
    )
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        f'{mounts} && exec "$@"',
        "slurmd",
        *argv,
    ]


def _start(root: Path, node: str, partition: str, hide: tuple[Path, ...] = ()) -> Slurm:
    for old in root.glob("slurm*.log"):
        old.unlink(missing_ok=True)
    # every user's sbatch must reach the config and munge's socket; the key stays root's
    for d in ("munge", "munge-key", "state", "spool", "munge-key/log"):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    os.chmod(root / "munge", 0o755)
    os.chmod(root / "munge-key", 0o700)
    key = root / "munge-key" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    conf = root / "slurm.conf"
    conf.write_text(_config(root, node, partition))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: list[subprocess.Popen[bytes]] = []
    slurm = Slurm(root, conf, partition, node, procs)
    try:
        subprocess.run(
            [
                _sbin("munged"),
                f"--socket={root}/munge/munge.socket",
                f"--key-file={key}",
                f"--pid-file={root}/munge-key/munged.pid",
                f"--log-file={root}/munge-key/log/munged.log",
                f"--seed-file={root}/munge-key/munged.seed",
                "--force",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        for argv in (
            [_sbin("slurmctld"), "-D", "-i", "-f", str(conf)],
            _hidden([_sbin("slurmd"), "-D", "-N", node, "-f", str(conf)], hide),
        ):
            procs.append(
                subprocess.Popen(
                    argv,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=open(root / f"{Path(argv[0]).name}.stderr", "wb"),  # noqa: SIM115
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        delay = 0.05
        while slurm.node_state() != "idle":
            if any(p.poll() is not None for p in procs) and "Address already in use" in (
                slurm.logs()
            ):
                raise PortTaken(slurm.logs())
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(
                    f"Slurm did not come up (node: {slurm.node_state()!r})\n{slurm.logs()}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
    except BaseException:
        stop(slurm)
        raise
    return slurm


def stop(slurm: Slurm) -> None:
    """Cancel what is left, stop the daemons and munged."""
    if slurm.procs:
        slurm.run("scancel", "--full", "-p", slurm.partition, check=False)
    for p in reversed(slurm.procs):
        if p.poll() is None:
            p.terminate()
    for p in slurm.procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
    pidfile = slurm.root / "munge-key" / "munged.pid"
    if pidfile.exists():
        try:
            pid = int(pidfile.read_text().split()[0])
            os.kill(pid, 15)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.05)
        except (ValueError, ProcessLookupError):
            pass


def slurm_fixture(
    tmp_path_factory: pytest.TempPathFactory, hide: tuple[Path, ...] = ()
) -> Iterator[Slurm]:
    """Body of a module- or session-scoped fixture (tests/test_slurm*.py); ``hide``: see start."""
    missing = missing_tools()
    if missing:
        pytest.skip(
            f"Slurm is not installed ({', '.join(missing)} missing): apt-get install "
            "slurm-wlm munge"
        )
    if os.geteuid() != 0:
        pytest.skip("the private Slurm needs root (slurmd runs jobs as their users)")
    # in /tmp, reachable by every user (pytest's own tmp is root's only); a short path: the
    # munge socket's must fit in sun_path
    root = Path(tempfile.mkdtemp(prefix="det-local-slurm-", dir="/tmp"))
    slurm = start(root, hide=hide)
    try:
        yield slurm
    finally:
        stop(slurm)
        shutil.rmtree(root, ignore_errors=True)
