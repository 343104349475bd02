"""Starting, signalling and reaping trial process groups.

Each run is a new session (its own process group), so a terminal's Ctrl-C reaches only
det-local, and a kill reaches every descendant (launcher workers included). Output goes
straight to the trial's log file, so a trial never depends on the daemon's pipes.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from det_local.errors import TrialError
from det_local.sched.plan import LaunchPlan


@dataclass
class Running:
    pid: int
    popen: subprocess.Popen[bytes] | None
    pidfd: int | None


def spawn(plan: LaunchPlan) -> Running:
    log = Path(plan.log_path)
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        popen = subprocess.Popen(
            plan.argv,
            cwd=plan.cwd,
            env=plan.env,
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    except OSError as err:
        raise TrialError(
            f"could not start {plan.argv[0]!r} in {plan.cwd}: {err.strerror}"
        ) from None
    finally:
        os.close(fd)
    try:
        pidfd: int | None = os.pidfd_open(popen.pid)
    except (AttributeError, OSError):
        pidfd = None
    return Running(popen.pid, popen, pidfd)


def signal_group(pid: int, sig: int) -> bool:
    """Send sig to the process group led by pid; False if it is already gone."""
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def exit_code(run: Running) -> int | None:
    """The exit code once the leader has exited (negative for a signal), else None."""
    if run.popen is not None:
        return run.popen.poll()
    return None


def close(run: Running) -> None:
    if run.pidfd is not None:
        try:
            os.close(run.pidfd)
        except OSError:
            pass
        run.pidfd = None


def terminate_group(pid: int) -> None:
    signal_group(pid, signal.SIGTERM)


def kill_group(pid: int) -> None:
    signal_group(pid, signal.SIGKILL)
