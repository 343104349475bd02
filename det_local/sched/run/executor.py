"""Starting, signalling, reaping and adopting job processes.

Each job is a new session (its own process group), so a terminal's Ctrl-C reaches only
det-local; where cgroups are available (`sched/run/cgroups.py`) each job also has its own cgroup,
which holds every process it starts, those that left its session with setsid included. Output
goes straight to the job's log file, so a job never depends on the daemon's pipes.

The group leader is a small shell wrapper. It first writes its own pid into the job's cgroups
(so that everything it starts is born inside), then runs the job's command, waits for it
(surviving SIGTERM/SIGHUP/SIGINT, which reach the command), and writes the command's exit status
to an exit file. A root daemon's wrapper stays root and drops privileges only for the command
(`setpriv`): the user can neither signal nor trace it, and its exit file lies in a directory of
root's (DET_LOCAL_HOME/run/exit), so the status the daemon trusts is out of the user's reach.
The daemon reads the status from waitpid for its own children and from that file for processes
it adopted after a restart (not its children, so waitpid can't). Every exit file is read with
`read_bounded`: a FIFO, a symlink or garbage ends that job with a one-line message, never
blocks the daemon.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from det_local.errors import TrialError
from det_local.sched.run import userfiles
from det_local.sched.run.cgroups import JobCgroup
from det_local.sched.run.launchplan import LaunchPlan
from det_local.store.safe_open import UnsafeFile, read_bounded

# The wrapper of det-local before containment: $0 is the exit file. Jobs it started are still
# found and adopted after an upgrade (`find_wrapper`); its exit file is the user's to write.
_LEGACY_WRAPPER = 'trap : TERM HUP INT QUIT\n"$@"\nr=$?\necho "$r" > "$0"\nexit $r\n'
# $0 is the exit file, $1 the number of cgroup.procs files that follow. The wrapper enters the
# job's cgroups before anything runs (and refuses to run the command outside them). The command
# (with setpriv's privilege drop in front of it for a root daemon) runs in the foreground: a
# trapped signal reaches the command (on exec a trapped signal is back at its default), and the
# shell runs the trap only once the command has ended, so the status written is the command's.
# POSIX sh (dash where /bin/sh is dash): half the start-up cost of bash, paid by every job.
_WRAPPER = (
    "trap : TERM HUP INT QUIT\n"
    "e=$0 n=$1\n"
    "shift\n"
    'while [ "$n" -gt 0 ]; do\n'
    '  echo $$ 2>/dev/null >"$1" || {\n'
    '    echo "det-local: the job could not enter its cgroup ($1); it did not run" >&2\n'
    "    exit 125\n"
    "  }\n"
    "  shift\n"
    "  n=$((n - 1))\n"
    "done\n"
    '"$@"\n'
    "r=$?\n"
    'echo "$r" >"$e"\n'
    "exit $r\n"
)
_SH = "/bin/sh" if os.access("/bin/sh", os.X_OK) else (shutil.which("bash") or "/bin/bash")
EXIT_FILE_MAX = 32  # "-128\n" at most from the wrapper: anything longer is not its


@dataclass
class JobProc:
    job_id: int
    pid: int
    popen: subprocess.Popen[bytes] | None  # None for an adopted process (not our child)
    pidfd: int | None
    exit_file: Path  # root's (the wrapper writes it): trusted
    cgroup: JobCgroup | None = None
    legacy_exit_file: Path | None = None  # a pre-upgrade wrapper's, the user's: bounded
    uid: int | None = None  # who may own the legacy exit file
    code: int | None = None  # the leader's exit status, once it has ended
    problem: str | None = None  # why the status could not be read (the job ends with it)
    started: float | None = None  # the leader's start time (tells it from a reused pid)
    forked: bool = False  # a warm start: forked by a zygote, which writes the legacy exit file


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


def wrap(argv: list[str], exit_file: Path, procs_files: list[str] | None = None) -> list[str]:
    procs = procs_files or []
    return [_SH, "-c", _WRAPPER, str(exit_file), str(len(procs)), *procs, *argv]


_ENV = shutil.which("env") or "/usr/bin/env"


def _drop_privileges(setpriv: str, uid: int, gid: int | None, groups: list[int]) -> list[str]:
    return [
        setpriv,
        f"--reuid={uid}",
        f"--regid={gid if gid is not None else uid}",
        f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
        "--",
    ]


def spawn(
    job_id: int,
    plan: LaunchPlan,
    exit_file: Path,
    *,
    cgroup: JobCgroup | None = None,
    legacy_exit_file: Path | None = None,
) -> JobProc:
    """Start the job's wrapper. A root daemon's wrapper stays root and runs the command through
    setpriv as its user, writing the status to `exit_file` in root's directory; where setpriv is
    missing (then cgroups are off), the legacy wrapper runs as the user and writes
    `legacy_exit_file` in the job's directory, owned by the user."""
    from det_local.sched.run.cgroups import setpriv

    log = Path(plan.log_path)
    log.parent.mkdir(parents=True, exist_ok=True)
    exit_file.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    for old in (exit_file, legacy_exit_file):
        if old is not None:
            try:
                old.unlink()
            except FileNotFoundError:
                pass
    # system mode: the submitter's file, mode from their umask, readable by admins
    fd = userfiles.open_log(log, userfiles.owner_of(plan))
    as_user: dict[str, object] = {}
    cwd = plan.cwd
    argv = wrap(plan.argv, exit_file, cgroup.procs_files() if cgroup is not None else None)
    legacy = False
    if plan.uid is not None and os.geteuid() == 0 and plan.uid != 0:
        # system mode: the job runs as its submitter
        drop = setpriv()
        if drop is not None:
            # the working directory is entered as the user (env -C, after setpriv), never by
            # the root wrapper: a job must not start in a directory its user cannot reach
            cwd = "/"
            argv = wrap(
                _drop_privileges(drop, plan.uid, plan.gid, plan.groups or [])
                + [_ENV, "-C", plan.cwd, "--"]
                + plan.argv,
                exit_file,
                cgroup.procs_files() if cgroup is not None else None,
            )
        else:
            if legacy_exit_file is None:
                raise TrialError("setpriv (util-linux) is needed to run a job as its user")
            legacy = True
            legacy_exit_file.parent.mkdir(parents=True, exist_ok=True)
            if legacy_exit_file.parent.stat().st_uid != plan.uid:
                os.chown(
                    legacy_exit_file.parent, plan.uid, plan.gid if plan.gid is not None else -1
                )
            argv = [_SH, "-c", _LEGACY_WRAPPER, str(legacy_exit_file), *plan.argv]
            as_user = {"user": plan.uid, "group": plan.gid, "extra_groups": plan.groups or []}
    try:
        popen = subprocess.Popen(  # type: ignore[call-overload]
            argv,
            cwd=cwd,
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
    return JobProc(
        job_id,
        popen.pid,
        popen,
        _pidfd(popen.pid),
        exit_file,
        cgroup,
        legacy_exit_file if legacy else None,
        plan.uid,
    )


def adopt(
    job_id: int,
    pid: int,
    exit_file: Path,
    *,
    cgroup: JobCgroup | None = None,
    legacy_exit_file: Path | None = None,
    uid: int | None = None,
) -> JobProc | None:
    """Watch a process started by an earlier daemon; None if it is gone."""
    fd = _pidfd(pid)
    if fd is None:
        return None
    return JobProc(job_id, pid, None, fd, exit_file, cgroup, legacy_exit_file, uid)


def find_wrapper(exit_file: Path, legacy_exit_file: Path | None = None) -> int | None:
    """The live wrapper of a job run, found by the exit file its argv names: how a restarted
    daemon finds a process that was spawned just before a crash, its pid not yet recorded.
    The wrapper of an earlier det-local (`legacy_exit_file`) is found too."""
    import psutil

    wanted = {(_WRAPPER, str(exit_file))}
    if legacy_exit_file is not None:
        wanted.add((_LEGACY_WRAPPER, str(legacy_exit_file)))
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info.get("cmdline") or []
        if len(argv) > 3 and argv[1] == "-c" and (argv[2], argv[3]) in wanted:
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
    None. For an adopted process: its exit file; -9 when it left none (killed) or when the file
    cannot be trusted (`proc.problem` then says why)."""
    if proc.popen is not None:
        return proc.popen.poll()
    if proc.forked and proc.pidfd is not None:
        # a warm trial is its zygote's child, reaped by it: its pid may be reused once it is
        # gone, its pidfd never
        if not select.select([proc.pidfd], [], [], 0)[0]:
            return None
    elif is_alive(proc.pid):
        return None
    _await_reaped(proc.pid)  # a warm trial (adopted too): its zygote records it, then reaps it
    code, proc.problem = exit_status(proc.exit_file, proc.legacy_exit_file, proc.uid)
    return -signal.SIGKILL if code is None else code


FORK_REAP_S = 1.0  # how long a warm trial's zygote may take to record its status and reap it


def _await_reaped(pid: int) -> None:
    """A process that is not our child has ended (a zombie): wait until its parent has reaped
    it. A warm trial's zygote writes its exit status before it reaps it (waitid WNOWAIT), so
    once the pid is gone the status is there; an adopted wrapper's parent is init, which reaps
    at once. Bounded: a zygote killed meanwhile leaves the child to init too."""
    deadline = time.monotonic() + FORK_REAP_S
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        time.sleep(0.002)


def exit_status(
    exit_file: Path, legacy_exit_file: Path | None = None, uid: int | None = None
) -> tuple[int | None, str | None]:
    """(status, None) from the trusted exit file, else from a pre-upgrade wrapper's file in the
    job's directory; (None, None) when there is neither; (None, why) when the one there is not
    a small regular file holding a number (a FIFO, a symlink, garbage): never blocks."""
    try:
        return read_exit_file(exit_file, owner=os.geteuid()), None
    except FileNotFoundError:
        pass
    except UnsafeFile as err:
        return None, str(err)
    if legacy_exit_file is None:
        return None, None
    try:
        return read_exit_file(legacy_exit_file, owner=uid), None
    except FileNotFoundError:
        return None, None
    except UnsafeFile as err:
        return None, str(err)


def read_exit_file(path: Path, owner: int | None = None) -> int:
    """The status a wrapper wrote; FileNotFoundError when there is none, UnsafeFile (one line)
    for anything that is not a small regular file holding a number."""
    data = read_bounded(path, EXIT_FILE_MAX, owner=owner, what="exit file")
    try:
        code = int(data.strip())
    except ValueError:
        raise UnsafeFile(f"exit file {path} does not hold an exit status: {data[:16]!r}") from None
    if not -255 <= code <= 255:
        raise UnsafeFile(f"exit file {path} holds {code}, not an exit status (-255 to 255)")
    return code


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
    """Send sig to the process group led by pid; False if it is already gone (or pid is not a
    process: 0 names a run without one, and killpg(0) would signal the daemon's own group)."""
    if pid <= 0:
        return False
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_group(pid: int) -> None:
    signal_group(pid, signal.SIGKILL)


def signal_job(proc: JobProc | None, pid: int | None, sig: int) -> None:
    """sig to every process of a job: its cgroup's (those that left its session included)
    where it has one, else its process group's."""
    if proc is not None and proc.cgroup is not None:
        if sig == signal.SIGKILL:
            proc.cgroup.kill()
        else:
            proc.cgroup.signal(sig)
        return
    if pid is not None:
        signal_group(pid, sig)


def kill_rest(proc: JobProc) -> bool:
    """Once the leader has ended, SIGKILL what is left of the job (no orphans); True when
    nothing is left, False while processes of its cgroup are still dying."""
    if proc.cgroup is None:
        kill_group(proc.pid)
        return True
    if not proc.cgroup.populated():
        return True
    proc.cgroup.kill()
    return not proc.cgroup.populated()


def release(proc: JobProc) -> None:
    """Remove the job's (empty) cgroup."""
    if proc.cgroup is not None:
        proc.cgroup.remove()
