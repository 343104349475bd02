"""Shared helpers for the benchmarks: a throwaway DET_LOCAL_HOME and the det-local command."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence


def det_local_cmd() -> list[str]:
    exe = shutil.which("det-local")
    return [exe] if exe else [sys.executable, "-m", "det_local.cli.main"]


def timed(argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None) -> float:
    """Wall time of one run in milliseconds; raises if the command fails."""
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True)
    elapsed = (time.perf_counter() - start) * 1000
    if proc.returncode != 0:
        raise SystemExit(
            f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}"
        )
    return elapsed


def median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def env_with_home(home: str) -> dict[str, str]:
    env = dict(os.environ)
    env["DET_LOCAL_HOME"] = home
    return env


# ---------------------------------------------------------------------- a daemon on a temp home
def daemon_pid(home: str) -> int | None:
    """The pid in HOME's daemon pid file, or None."""
    import json

    try:
        with open(os.path.join(home, "run", "daemon.pid")) as f:
            return int(json.load(f)["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Daemon:
    """`det-local daemon start` on HOME with extra environment; stopped (or killed) on exit,
    even when the benchmark fails."""

    def __init__(self, home: str, **extra_env: str) -> None:
        self.home = home
        self.env = {**env_with_home(home), **extra_env}
        self.pid: int | None = None

    def __enter__(self) -> Daemon:
        proc = subprocess.run(
            [*det_local_cmd(), "daemon", "start"], env=self.env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise SystemExit(f"det-local daemon start failed: {proc.stderr.strip()[-2000:]}")
        self.pid = daemon_pid(self.home)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the daemon, then end the process groups of jobs it left running (a daemon's
        jobs outlive it by design; a benchmark's must not)."""
        if self.pid is None:
            return
        subprocess.run(
            [*det_local_cmd(), "daemon", "stop"], env=self.env, capture_output=True, timeout=60
        )
        try:  # it did not stop: it was ours, end it
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass
        self.pid = None
        kill_running_jobs(self.home)


def kill_running_jobs(home: str) -> int:
    """SIGKILL the process group of every job HOME's store records as running; returns how many
    groups were still there."""
    import signal
    import sqlite3

    db = os.path.join(home, "det-local.db")
    if not os.path.exists(db):
        return 0
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        pids = [r[0] for r in conn.execute("SELECT pid FROM jobs WHERE state='SCHEDULED'") if r[0]]
    finally:
        conn.close()
    n = 0
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
            n += 1
        except (ProcessLookupError, PermissionError):
            pass
    return n


# ---------------------------------------------------------------------- task-spooler, the peer
def find_tsp(install: bool = True) -> str | None:
    """The task-spooler binary (`tsp` on Debian, `ts` elsewhere); with install, try apt-get once
    (as root) when it is missing. None when it cannot be had."""
    for name in ("tsp", "ts"):
        exe = shutil.which(name)
        if exe and (name == "tsp" or _is_task_spooler(exe)):
            return exe
    if install and os.geteuid() == 0 and shutil.which("apt-get"):
        cmd = (
            "apt-get install -y task-spooler || (apt-get update && apt-get install -y task-spooler)"
        )
        subprocess.run(
            ["sh", "-c", cmd],
            capture_output=True,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        return find_tsp(install=False)
    return None


def _is_task_spooler(exe: str) -> bool:
    try:
        out = subprocess.run([exe, "-h"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "spooler" in (out.stdout + out.stderr).lower()


class Tsp:
    """A private task-spooler server (TS_SOCKET and TMPDIR in DIR); `tsp -K` on exit."""

    def __init__(self, exe: str, tmp_dir: str, slots: int = 1) -> None:
        self.exe = exe
        os.makedirs(tmp_dir, exist_ok=True)
        self.env = dict(os.environ)
        self.env.update(
            TS_SOCKET=os.path.join(tmp_dir, "ts.sock"),
            TMPDIR=tmp_dir,  # where its output files go
            TS_MAXFINISHED="100000",  # keep every finished job, so `tsp -l` lists them all
        )
        self.env.pop("TS_SAVELIST", None)
        self.slots = slots

    def __call__(self, *args: str, check: bool = True) -> str:
        proc = subprocess.run([self.exe, *args], env=self.env, capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise SystemExit(f"tsp {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout

    def server_pid(self) -> int | None:
        """The server: the tsp process listening on this socket."""
        import psutil

        sock = self.env["TS_SOCKET"]
        for p in psutil.process_iter(["name"]):
            if p.info["name"] not in ("tsp", "ts"):
                continue
            try:
                for c in p.net_connections(kind="unix"):
                    if c.laddr == sock and not c.raddr:
                        return p.pid
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return None

    def __enter__(self) -> Tsp:
        self("-S", str(self.slots))  # starts the server
        return self

    def __exit__(self, *exc: object) -> None:
        self("-K", check=False)
