"""Worker supervision for the launchers (Determined's pid_server/pid_client, in one place).

A launcher runs the framework's own launcher (torchrun, deepspeed, horovodrun) under a
:class:`Supervisor`. Each worker runs under ``wrap_rank``, which connects to the supervisor's
unix socket (DET_LOCAL_SUPERVISOR) and reports ``start RANK WRAPPER_PID WORKER_PID`` and, when
its worker ends, ``exit RANK STATUS``. The supervisor:

1. on the first worker that exits non-zero, is killed by a signal, or whose wrapper vanishes
   without reporting: says so in one line, gives the framework's launcher ``GRACE`` seconds to
   stop the others itself (torchrun does, within its 0.1 s monitor interval), then sends
   SIGTERM to every worker, and ``KILL_AFTER`` seconds later SIGKILL to whatever is left of the
   process tree, the framework's launcher included; everything is gone within 5 s of the
   failure even when a worker ignores SIGTERM or hangs in a collective;
2. forwards SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 to the framework's launcher, and
   after SIGTERM/SIGINT/SIGHUP kills what is left ``STOP_TIMEOUT`` seconds later;
3. is a child subreaper (Linux), so workers orphaned by a dying framework launcher are still its
   descendants; when the framework's launcher exits, any process left in the tree is ended:
   nothing outlives the launch;
4. exits with the failed worker's status (128 + signal for a signal) if one failed, else with
   the framework launcher's status; 0 only when that is 0 and no worker failed.

Supervision is event-driven (a pidfd for the child, the socket, a signal wake-up fd); it ticks
only while it tears the tree down.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil

from det_local.launch.wrap_rank import FIRST_FAILURE_ENV, SUPERVISOR_ENV, signal_name

GRACE = 0.5
KILL_AFTER = 2.0
STOP_TIMEOUT = 5.0
FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
STOPPING = ("SIGINT", "SIGTERM", "SIGHUP")
TICK = 0.05


def say(message: str) -> None:
    """One line from the launcher (not a worker: no rank prefix)."""
    sys.stderr.write(f"det-local: {message}\n")
    sys.stderr.flush()


def exit_status(returncode: int) -> int:
    """A process's status as a shell reports it: 128 + signal for a signal."""
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal_name(-returncode)}"
    if returncode > 128 and returncode - 128 < signal.NSIG:
        return f"exited with code {returncode} (killed by {signal_name(returncode - 128)})"
    return f"exited with code {returncode}"


def become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(36, 1, 0, 0, 0) == 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:
        return False


@dataclass
class _Worker:
    rank: int
    wrapper_pid: int
    pid: int
    status: int | None = None  # raw returncode reported by wrap_rank


@dataclass
class Failure:
    rank: int | None
    returncode: int
    what: str


@dataclass
class _State:
    workers: dict[int, _Worker] = field(default_factory=dict)  # by rank
    conns: dict[socket.socket, bytearray] = field(default_factory=dict)
    conn_rank: dict[socket.socket, int] = field(default_factory=dict)
    failure: Failure | None = None
    failed_at: float | None = None
    termed: bool = False
    stop_at: float | None = None  # an outside SIGTERM/SIGINT: kill everything then
    killed: bool = False


class Supervisor:
    """Run one command (the framework's launcher) and supervise the workers under it."""

    def __init__(self, num_workers: int, *, grace: float = GRACE) -> None:
        self.num_workers = num_workers
        self.grace = grace
        self._dir = tempfile.mkdtemp(prefix="det-local-launch-")
        self.path = os.path.join(self._dir, "supervisor.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(max(num_workers, 16))
        self._listener.setblocking(False)
        self.state = _State()

    def env(self) -> dict[str, str]:
        return {SUPERVISOR_ENV: self.path}

    def close(self) -> None:
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------ run
    def run(self, cmd: list[str], env: dict[str, str] | None = None, name: str = "") -> int:
        """Run cmd (``name`` in messages) until it exits; its status, or the failed worker's."""
        become_subreaper()
        full_env = dict(os.environ if env is None else env)
        full_env.update(self.env())
        try:
            proc = subprocess.Popen(cmd, env=full_env)
        except OSError as err:
            say(f"error: cannot run {cmd[0]!r}: {err.strerror or err}")
            self.close()
            return 127
        try:
            with self._signals(proc) as wake:
                code = self._loop(proc, wake)
            st = self.state
            if code and st.failure is None and not st.workers and st.stop_at is None:
                say(
                    f"{name or cmd[0]} exited with code {code} before any worker started; its "
                    "messages above say why"
                )
        finally:
            self._sweep(proc)
            self.close()
        return code

    @contextlib.contextmanager
    def _signals(self, proc: subprocess.Popen[bytes]) -> Iterator[socket.socket]:
        """Forward signals to proc; wake the loop through a socketpair."""
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        if threading.current_thread() is not threading.main_thread():
            try:  # signals are the main thread's: the loop still ends with the child
                yield r
            finally:
                r.close()
                w.close()
            return
        old_wakeup = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        state = self.state

        def forward(signum: int, _frame: object) -> None:
            try:
                proc.send_signal(signum)
            except OSError:
                pass
            if signal.Signals(signum).name in STOPPING and state.stop_at is None:
                state.stop_at = time.monotonic() + STOP_TIMEOUT

        old = {}
        for name in FORWARDED:
            sig = getattr(signal, name)
            old[sig] = signal.signal(sig, forward)
        try:
            yield r
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(old_wakeup)
            r.close()
            w.close()

    def _loop(self, proc: subprocess.Popen[bytes], wake: socket.socket) -> int:
        st = self.state
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, "listener")
        sel.register(wake, selectors.EVENT_READ, "wake")
        pidfd = -1
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ, "child")
        except (AttributeError, OSError):
            pass
        try:
            while True:
                if proc.poll() is not None:
                    self._drain(sel)
                    break
                timeout = None if pidfd >= 0 else TICK
                if st.failed_at is not None or st.stop_at is not None:
                    timeout = TICK
                for key, _ in sel.select(timeout):
                    if key.data == "listener":
                        self._accept(sel)
                    elif key.data == "wake":
                        try:
                            wake.recv(4096)
                        except OSError:
                            pass
                    elif key.data == "conn":
                        assert isinstance(key.fileobj, socket.socket)
                        self._read(sel, key.fileobj)
                self._escalate(proc)
        finally:
            sel.close()
            if pidfd >= 0:
                os.close(pidfd)
        returncode = proc.wait()
        if st.failure is not None:
            return exit_status(st.failure.returncode) or exit_status(returncode) or 1
        return exit_status(returncode)

    # ------------------------------------------------------------------ worker reports
    def _accept(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            conn.setblocking(False)
            self.state.conns[conn] = bytearray()
            sel.register(conn, selectors.EVENT_READ, "conn")

    def _read(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        st = self.state
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        buf = st.conns.get(conn)
        if buf is None:
            return
        buf += data
        while b"\n" in buf:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            self._message(conn, line.decode(errors="replace").split())
        if not data:  # the wrapper is gone
            sel.unregister(conn)
            conn.close()
            del st.conns[conn]
            rank = st.conn_rank.pop(conn, None)
            worker = st.workers.get(rank) if rank is not None else None
            if worker is not None and worker.status is None:
                self._fail(
                    Failure(rank, -signal.SIGKILL, "its wrapper (wrap_rank) died without a word")
                )

    def _message(self, conn: socket.socket, words: list[str]) -> None:
        st = self.state
        try:
            if words[0] == "start":
                rank, wrapper, pid = int(words[1]), int(words[2]), int(words[3])
                st.workers[rank] = _Worker(rank, wrapper, pid)
                st.conn_rank[conn] = rank
            elif words[0] == "exit":
                rank, status = int(words[1]), int(words[2])
                worker = st.workers.setdefault(rank, _Worker(rank, 0, 0))
                worker.status = status
                if status != 0:
                    self._fail(Failure(rank, status, describe(status)))
        except (IndexError, ValueError):
            return

    # ------------------------------------------------------------------ failure
    def _fail(self, failure: Failure) -> None:
        st = self.state
        if st.failure is not None:
            return
        st.failure = failure
        st.failed_at = time.monotonic()
        others = [w.rank for w in st.workers.values() if w.status is None]
        tail = f"; stopping the other workers ({len(others)} running)" if others else ""
        say(f"rank {failure.rank} {failure.what}{tail}")
        _record_failure(failure)

    def _escalate(self, proc: subprocess.Popen[bytes]) -> None:
        st = self.state
        now = time.monotonic()
        if st.failed_at is not None:
            if not st.termed and now >= st.failed_at + self.grace:
                st.termed = True
                for worker in st.workers.values():
                    if worker.status is None:
                        for pid in (worker.pid, worker.wrapper_pid):
                            _signal(pid, signal.SIGTERM)
            if not st.killed and now >= st.failed_at + self.grace + KILL_AFTER:
                self._kill_tree(proc)
        if st.stop_at is not None and not st.killed and now >= st.stop_at:
            self._kill_tree(proc)

    def _kill_tree(self, proc: subprocess.Popen[bytes]) -> None:
        self.state.killed = True
        for p in _descendants():
            _signal(p.pid, signal.SIGKILL)
        _signal(proc.pid, signal.SIGKILL)

    def _drain(self, sel: selectors.BaseSelector) -> None:
        """Read the reports that arrived just before the child exited."""
        for key, _ in sel.select(0):
            if key.data == "conn":
                assert isinstance(key.fileobj, socket.socket)
                self._read(sel, key.fileobj)

    def _sweep(self, proc: subprocess.Popen[bytes]) -> None:
        """After the framework's launcher: end and reap anything left in the tree."""
        if proc.poll() is None:
            _signal(proc.pid, signal.SIGKILL)
            proc.wait()
        left = _descendants()
        if not left:
            return
        for p in left:
            _signal(p.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(left, timeout=KILL_AFTER)
        for p in alive:
            _signal(p.pid, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=1.0)


def _record_failure(failure: Failure) -> None:
    """The first failing rank, its status and when, for whoever started this launcher and asked
    (``DET_LOCAL_FIRST_FAILURE``: `slurm/node.py` names it when the trial ends). Best effort."""
    path = os.environ.get(FIRST_FAILURE_ENV)
    if not path:
        return
    tmp = f"{path}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            rank = "-" if failure.rank is None else failure.rank
            f.write(f"{rank} {exit_status(failure.returncode)} {time.time()!r}\n")
        os.replace(tmp, path)
    except OSError:
        pass


def _descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _signal(pid: int, sig: int) -> None:
    if pid <= 0:
        return
    try:
        os.kill(pid, sig)
    except OSError:
        pass
