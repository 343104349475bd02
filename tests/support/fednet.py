"""Network namespaces for federation tests: one namespace per node, a bridge in its own.

    with Net() as net:
        a = net.node(1)           # namespace <prefix>-n1, eth0 = 10.77.0.1/24 on the bridge
        d = a.start_daemon(...)   # `det-local daemon` in that namespace, its own home

Names carry a per-run prefix (`dlf<pid>`); everything is removed in `finally`, and `sweep()`
(run at the start of a session) removes what a run that died left behind. The root namespace
gets no interface: nothing a node sends can reach the host's NICs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.paths import REPO
from tests.support.reach import python_reachable
from tests.support.users import A
from tests.support.world import wait_for

PREFIX = "dlf"
SUBNET = "10.77.0"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def namespaces() -> list[str]:
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def sweep() -> None:
    """Remove namespaces of earlier runs whose process is gone."""
    for ns in namespaces():
        if not ns.startswith(PREFIX):
            continue
        pid = ns[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and Path(f"/proc/{pid}").exists() and int(pid) != os.getpid():
            continue
        if pid.isdigit() and int(pid) == os.getpid():
            continue
        ip("netns", "del", ns, check=False)


def reachable(path: Path) -> Path:
    """Let every user traverse `path` and the directories above it (o+x, not o+r): work a
    peer lends runs as an ordinary account, never root, and must reach its directory."""
    for p in [path, *path.parents]:
        mode = p.stat().st_mode & 0o7777
        if not mode & 0o001:
            p.chmod(mode | 0o001)
    return path


def readable(path: Path) -> None:
    """o+r on a file, o+rx on a tree (a config and a context the submitter reads)."""
    for p in [path, *(path.rglob("*") if path.is_dir() else [])]:
        if p.is_symlink():
            continue
        mode = p.stat().st_mode & 0o7777
        p.chmod(mode | (0o005 if p.is_dir() else 0o004))


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DET_LOCAL_", "PYTEST_")) or k == "DET_LOCAL_TEST_USERS"
    }
    env.update(
        DET_LOCAL_HOME=str(home),
        PYTHONPATH=str(REPO),
        DET_LOCAL_CPU_SLOTS="1",
        DET_LOCAL_CGROUPS="off",
    )
    env.update(extra)
    return env


SUBMITS = (("run",), ("experiment", "create"), ("cmd", "run"))


def submitter() -> str | None:
    """The ordinary account work is submitted as (`conftest.accounts` creates it): a lending
    machine never runs root's work from a peer. None when it does not exist."""
    import pwd

    try:
        pwd.getpwnam(A)
    except KeyError:
        return None
    return A


def as_submitter() -> dict[str, Any]:
    """subprocess arguments that run a command as `submitter()` (its group, no others)."""
    import pwd

    user = submitter()
    assert user is not None, "no submitting account: use the `accounts` fixture"
    return {"user": user, "group": pwd.getpwnam(user).pw_gid, "extra_groups": []}


@contextlib.contextmanager
def submitter_account() -> Any:
    """For the benches (no pytest fixtures): the submitting account for the run's length."""
    made = submitter() is None
    if made:
        subprocess.run(
            ["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", A], check=True, capture_output=True
        )
    try:
        with python_reachable():
            yield A
    finally:
        if made:
            subprocess.run(["userdel", "-f", A], capture_output=True)


def cli(
    home: Path, *args: str, timeout: float = 60.0, user: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """The det-local CLI (in the root namespace: it speaks to its daemon over a unix socket).
    A submission (`run`, `experiment create`, `cmd run`) runs as `submitter()` unless `user`
    says otherwise ("root": as root); the home and every path argument are made reachable."""
    if user is None and any(tuple(args[: len(s)]) == s for s in SUBMITS) and os.geteuid() == 0:
        user = submitter()
    if user == "root":
        user = None
    ids: dict[str, Any] = {}
    if user is not None:
        import pwd

        reachable(home)
        for arg in args:
            if arg.startswith("/") and Path(arg).exists():
                readable(reachable(Path(arg)))
        ids = {"user": user, "group": pwd.getpwnam(user).pw_gid, "extra_groups": []}
    # the account runs this checkout's Python: reachable for as long as the command runs (a
    # test that made no namespaces holds nothing else; the `accounts` fixture of an earlier
    # module is enough to make a submission run as the account)
    held = python_reachable(account=user) if user is not None else contextlib.nullcontext()
    with held:
        return subprocess.run(
            [sys.executable, "-m", "det_local.cli.main", *args],
            env=cli_env(home, **env),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd="/" if user is not None else None,
            **ids,
        )


@dataclass
class Node:
    net: Net
    index: int
    home: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def ns(self) -> str:
        return f"{self.net.prefix}-n{self.index}"

    @property
    def addr(self) -> str:
        return f"{self.net.subnet}.{self.index}"

    @property
    def log(self) -> Path:
        return self.home / "daemon-test.log"

    def start(self, **env: str) -> Node:
        self.env = env or self.env
        full = cli_env(self.home, **{"DET_LOCAL_NODE_ID": f"n{self.index}", **self.env})
        self.home.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.ns,
                    "env",
                    *(f"{k}={v}" for k, v in full.items()),
                    sys.executable,
                    "-m",
                    "det_local.cli.main",
                    "daemon",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env={"PATH": os.environ["PATH"]},
                start_new_session=True,
            )
        # the daemon writes its pid file (atomically) once it serves; a daemon killed with -9
        # left its own behind: wait for the file naming this one
        wait_for(
            lambda: self._serving() or self._died(),
            timeout=60,
            what=f"daemon n{self.index} to start",
        )
        assert not self._died(), self.log_text()
        return self

    def _serving(self) -> bool:
        try:
            info = json.loads(self.home.joinpath("run", "daemon.pid").read_text())
        except (OSError, ValueError):
            return False
        return self.proc is not None and info.get("pid") == self.proc.pid

    def _died(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.wait(10)

    def pids(self) -> list[int]:
        """Every process in the node's namespace: its daemon and its ranks."""
        res = ip("netns", "pids", self.ns, check=False)
        return [int(p) for p in res.stdout.split()]

    def signal_all(self, sig: int) -> None:
        """Signal the whole machine: SIGSTOP freezes it, SIGCONT thaws it, SIGKILL kills it."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        (self.home / "run" / "daemon.pid").unlink(missing_ok=True)

    def cli(
        self, *args: str, timeout: float = 60.0, user: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return cli(self.home, *args, timeout=timeout, user=user)

    def peers(self) -> dict[str, dict[str, Any]]:
        res = self.cli("cluster", "peers", "--json", timeout=30)
        if res.returncode != 0:
            return {}
        return {row["id"]: row for row in json.loads(res.stdout)}

    def states(self) -> dict[str, str]:
        return {k: v["state"] for k, v in self.peers().items()}

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def in_ns(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.ns, *argv], capture_output=True, text=True, timeout=timeout
        )


class Net:
    def __init__(self, root: Path, subnet: str = SUBNET) -> None:
        """``subnet``: the bridge's /24 (first three octets). The default is used inside the
        namespaces only; a net that also puts an address in the host's namespace
        (tests/support/slurmnodes.py) takes a free one of its own."""
        self.prefix = f"{PREFIX}{os.getpid()}"
        self.root = root
        self.subnet = subnet
        self.nodes: list[Node] = []
        self.created: list[str] = []

    @property
    def sw(self) -> str:
        return f"{self.prefix}-sw"

    def __enter__(self) -> Net:
        for ns in namespaces():  # a test of this run that failed to clean up
            if ns.startswith(self.prefix + "-"):
                ip("netns", "del", ns, check=False)
        ip("netns", "add", self.sw)
        self.created.append(self.sw)
        ip("-n", self.sw, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        ip("-n", self.sw, "link", "set", "br0", "up")
        return self

    def node(self, index: int, key: bytes | None = None) -> Node:
        ns = f"{self.prefix}-n{index}"
        ip("netns", "add", ns)
        self.created.append(ns)
        ip(
            "-n",
            self.sw,
            "link",
            "add",
            f"v{index}",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            ns,
        )
        ip("-n", self.sw, "link", "set", f"v{index}", "master", "br0", "up")
        ip("-n", ns, "addr", "add", f"{self.subnet}.{index}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up", "multicast", "on")
        ip("-n", ns, "link", "set", "lo", "up")
        node = Node(self, index, self.root / f"home{index}")
        node.home.mkdir(parents=True, exist_ok=True)
        if key is not None:
            from det_local.federate.keys import write_key

            write_key(node.home / "cluster.key", key)
        self.nodes.append(node)
        return node

    def link(self, index: int, up: bool) -> None:
        ip("-n", self.sw, "link", "set", f"v{index}", "up" if up else "down")

    def __exit__(self, *exc: object) -> None:
        try:
            for node in self.nodes:
                try:
                    node.signal_all(signal.SIGCONT)  # a node a test froze
                    node.stop()
                except Exception:
                    pass
            for node in self.nodes:  # ranks a stopped daemon left behind
                with contextlib.suppress(Exception):
                    node.signal_all(signal.SIGKILL)
        finally:
            for ns in reversed(self.created):
                ip("netns", "del", ns, check=False)
            deadline = time.monotonic() + 10
            while any(ns in namespaces() for ns in self.created) and time.monotonic() < deadline:
                time.sleep(0.05)
