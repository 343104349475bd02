"""`det-local daemon start | stop | status`: the client's side of the daemon (`sched/daemon.py`
is the daemon's own): start one detached and wait until it serves, ask it to stop and wait until
it has, and what status shows of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from det_local.client.requester import remote_request
from det_local.sched.daemon import DaemonError, DaemonInfo, read_pid_file, running_daemon
from det_local.store.paths import Paths
from det_local.store.states import JobState

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
LOG_NAME = "daemon.log"
LOG_MODE = 0o600  # its owner's only: it names every user's jobs and their command lines


def open_log(path: Path) -> int:
    """The daemon's log opened for appending, made (or made again) its owner's only: a log an
    earlier version left world-readable is re-moded. Not followed if it is a symbolic link."""
    fd = os.open(
        path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, LOG_MODE
    )
    try:
        os.fchmod(fd, LOG_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


def start_background(paths: Paths) -> DaemonInfo:
    """`det-local daemon start`: a detached daemon; returns once it serves (or fails)."""
    info = running_daemon(paths)
    if info is not None:
        raise DaemonError(
            f"a det-local daemon is already running for {paths.home} (pid {info.pid})"
        )
    paths.ensure()
    log_path = paths.run_dir / LOG_NAME
    with os.fdopen(open_log(log_path), "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "det_local.cli.main", "daemon"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            env={**os.environ, "DET_LOCAL_HOME": str(paths.home)},
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        info = read_pid_file(paths)
        if info is not None and info.pid == proc.pid and paths.socket.exists():
            return info
        if proc.poll() is not None:
            tail = _tail(log_path)
            raise DaemonError(f"the det-local daemon exited at start ({tail}); see {log_path}")
        time.sleep(0.02)
    raise DaemonError(
        f"the det-local daemon did not come up in {START_TIMEOUT_S:.0f}s; see {log_path}"
    )


def stop(paths: Paths) -> str:
    """`det-local daemon stop`: ask the daemon to stop (jobs keep running), wait for it."""
    info = running_daemon(paths)
    if info is None:
        return f"no det-local daemon is running for {paths.home}"
    process = _process(info.pid)
    remote_request(paths, "daemon_stop", {}, timeout=STOP_TIMEOUT_S)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        # its lock goes first, then the process: "stopped" once the process has exited
        if running_daemon(paths) is None and not _alive(process):
            return f"det-local daemon {info.pid} stopped"
        time.sleep(0.02)
    raise DaemonError(f"det-local daemon {info.pid} did not stop in {STOP_TIMEOUT_S:.0f}s")


def _process(pid: int) -> Any:
    """The daemon's process (psutil, which tells a reused pid apart), or None if gone."""
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _alive(process: Any) -> bool:
    """Still running: neither exited (a zombie has exited) nor replaced by a reused pid."""
    import psutil

    if process is None:
        return False
    try:
        return bool(process.is_running()) and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def status(paths: Paths) -> dict[str, Any]:
    from det_local.store.db import Store

    info = running_daemon(paths)
    out: dict[str, Any] = {"home": str(paths.home), "running": info is not None}
    if info is not None:
        out["pid"] = info.pid
        out["uptime_s"] = round(time.time() - info.started_at, 1)
        try:  # what psutil's memory_info().rss reads, without importing psutil (~10 ms)
            with open(f"/proc/{info.pid}/statm", "rb") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            out["rss_mb"] = round(rss / 2**20, 1)
        except Exception:
            pass
        try:  # what the daemon wrote at its start: how it contains jobs (cgroups or not)
            containment = json.loads(paths.pid_file.read_text()).get("containment")
        except (OSError, ValueError, AttributeError):
            containment = None
        if isinstance(containment, dict):
            out["containment"] = containment
        from det_local.health.looplag import read as read_loop_lag

        lag = read_loop_lag(paths.run_dir)
        if lag is not None:
            out["loop_lag_ms"] = lag
    store = Store(paths.db, readonly=True)  # a read-only view (empty when nothing ran yet)
    jobs = store.jobs.active()
    out["queued"] = sum(j.state == JobState.QUEUED for j in jobs)
    out["running_jobs"] = sum(j.state == JobState.SCHEDULED for j in jobs)
    out["pending_requests"] = len(list(paths.queue.glob("*.req"))) if paths.queue.exists() else 0
    return out


def _tail(path: Path, n: int = 1) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
        return " / ".join(lines[-n:]) or "no output"
    except OSError:
        return "no output"
