"""Starting, signalling, reaping and adopting job process groups.

Each job is a new session (its own process group), so a terminal's Ctrl-C reaches only
det-local, and a kill reaches every descendant (launcher workers included). Output goes
straight to the job's log file, so a job never depends on the daemon's pipes.

The group leader is a small shell wrapper that runs the job's command, waits for it (surviving
SIGTERM/SIGHUP/SIGINT, which reach the command through the group), and writes the command's
exit status to an exit file. The daemon reads the status from waitpid for its own children and
from that file for processes it adopted after a restart (not its children, so waitpid can't).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from det_local.errors import TrialError
from det_local.sched import userfiles
from det_local.sched.plan import LaunchPlan

# $0 is the exit file. The command runs in the foreground: a trapped signal reaches the
# command through the group (on exec a trapped signal is back at its default), and the shell
# runs the trap only once the command has ended, so the status written is the command's.
# POSIX sh (dash where /bin/sh is dash): half the start-up cost of bash, paid by every job.
_WRAPPER = 'trap : TERM HUP INT QUIT\n"$@"\nr=$?\necho "$r" > "$0"\nexit $r\n'
_SH = "/bin/sh" if os.access("/bin/sh", os.X_OK) else (shutil.which("bash") or "/bin/bash")


@dataclass
class JobProc:
    job_id: int
    pid: int
    popen: subprocess.Popen[bytes] | None  # None for an adopted process (not our child)
    pidfd: int | None
    exit_file: Path


@contextlib.contextmanager
def acting_as(
    uid: int | None = None, gid: int | None = None, groups: list[int] | None = None
) -> Iterator[None]:
    """Within the block, file access has the rights of this user (effective ids only; the saved
    root id brings root back after). What a root daemon reads or creates for a user, it does
    with that user's rights, never its own. A no-op unless root acts for another user."""
    if uid is None or uid == 0 or os.geteuid() != 0:
        yield
        return
    egid, saved_groups = os.getegid(), os.getgroups()
    os.setgroups(groups or [])
    os.setegid(gid if gid is not None else uid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(egid)
        os.setgroups(saved_groups)


def wrap(argv: list[str], exit_file: Path) -> list[str]:
    return [_SH, "-c", _WRAPPER, str(exit_file), *argv]


def spawn(job_id: int, plan: LaunchPlan, exit_file: Path) -> JobProc:
    log = Path(plan.log_path)
    log.parent.mkdir(parents=True, exist_ok=True)
    exit_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        exit_file.unlink()
    except FileNotFoundError:
        pass
    # system mode: the submitter's file, mode from their umask, readable by admins
    fd = userfiles.open_log(log, userfiles.owner_of(plan))
    as_user: dict[str, object] = {}
    if plan.uid is not None and os.geteuid() == 0 and plan.uid != 0:
        # system mode: the job runs as its submitter
        if exit_file.parent.stat().st_uid != plan.uid:
            os.chown(exit_file.parent, plan.uid, plan.gid if plan.gid is not None else -1)
        as_user = {"user": plan.uid, "group": plan.gid, "extra_groups": plan.groups or []}
    try:
        popen = subprocess.Popen(  # type: ignore[call-overload]
            wrap(plan.argv, exit_file),
            cwd=plan.cwd,
            env=plan.env,
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            umask=-1 if plan.umask is None else plan.umask,
            **as_user,
        )
    except OSError as err:
        raise TrialError(
            f"could not start {plan.argv[0]!r} in {plan.cwd}: {err.strerror}"
        ) from None
    finally:
        os.close(fd)
    return JobProc(job_id, popen.pid, popen, _pidfd(popen.pid), exit_file)


def adopt(job_id: int, pid: int, exit_file: Path) -> JobProc | None:
    """Watch a process started by an earlier daemon; None if it is gone."""
    fd = _pidfd(pid)
    if fd is None:
        return None
    return JobProc(job_id, pid, None, fd, exit_file)


def find_wrapper(exit_file: Path) -> int | None:
    """The live wrapper of a job run, found by the exit file its argv names: how a restarted
    daemon finds a process that was spawned just before a crash, its pid not yet recorded."""
    import psutil

    target = str(exit_file)
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info.get("cmdline") or []
        if len(argv) > 3 and argv[1] == "-c" and argv[2] == _WRAPPER and argv[3] == target:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == proc.pid:
                    return proc.pid
            except (psutil.Error, OSError):
                continue
    return None


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def start_time(pid: int) -> float | None:
    """The process's start time (boot time + /proc/PID/stat's starttime, as psutil's
    create_time computes it), to tell it from a reused pid. Read from /proc directly: this runs
    at every spawn, and importing psutil costs more than the read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])
        return _boot_time() + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


_BOOT: list[float] = []


def _boot_time() -> float:
    if not _BOOT:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    _BOOT.append(float(line.split()[1]))
                    break
            else:
                _BOOT.append(0.0)
    return _BOOT[0]


def is_same_process(pid: int, started: float | None) -> bool:
    if started is None:
        return False
    now = start_time(pid)
    if now is None:
        return False
    import psutil

    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return False
    except psutil.NoSuchProcess:
        return False
    return abs(now - started) < 0.5


def exit_code(proc: JobProc) -> int | None:
    """The exit code once the process has exited (negative for a signal, from waitpid), else
    None. For an adopted process: the wrapper's exit file, or -9 when it left none (killed)."""
    if proc.popen is not None:
        return proc.popen.poll()
    if is_alive(proc.pid):
        return None
    return read_exit_file(proc.exit_file, default=-signal.SIGKILL)


def read_exit_file(path: Path, default: int | None = None) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return default


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def close(proc: JobProc) -> None:
    if proc.pidfd is not None:
        try:
            os.close(proc.pidfd)
        except OSError:
            pass
        proc.pidfd = None


def signal_group(pid: int, sig: int) -> bool:
    """Send sig to the process group led by pid; False if it is already gone."""
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def terminate_group(pid: int) -> None:
    signal_group(pid, signal.SIGTERM)


def kill_group(pid: int) -> None:
    signal_group(pid, signal.SIGKILL)
