"""The zygote: a pre-started trial process that has imported the heavy modules, from which each
trial of one experiment is forked (a warm start), instead of a fresh interpreter paying for
``import torch`` again.

It runs as the trial's user, started by the daemon through the same wrapper and privilege drop
as a trial (``sched/warm/zygotes.py``)::

    python3 -m det_local.trial.zygote SOCKET DAEMON_PID DAEMON_UID MODULE[,MODULE...]

It imports the modules (and, of torch, what torch imports lazily on a trial's first optimizer:
``LAZY``), checks that the fork is safe (CUDA not initialised; no thread but the main one and
fork-safe helpers, FORK_SAFE_THREADS, once a probe fork has let libraries stop their pools with
their own atfork handlers; jemalloc's background thread is switched off before the preload), then
listens on SOCKET (its directory is the user's, mode 0700; the socket 0600; bound as SOCKET.new and
renamed into place once listening: the path never names a socket that refuses) for fork requests,
accepted only from the daemon's uid (SO_PEERCRED: root or DAEMON_UID). A request is the trial's log
descriptor (SCM_RIGHTS) and a frame ``{t: fork, argv, env, cwd, umask, exit_file}``; the zygote
forks. The child makes itself what a fresh trial process would be (its own session, umask,
stdout/stderr to the log, stdin /dev/null), answers ``{t: forked, pid}`` (so the daemon's process
group is there when it learns the pid), waits for the daemon's ``{t: go}`` (sent once the daemon
has moved it into the job's cgroup, having checked the pid), takes its cwd, exactly ``env`` (plus
what a fresh interpreter adds to it at start-up: the C locale coercion's LC_CTYPE,
:func:`interpreter_added`, and what the preloaded modules set at import, as the trial's own imports
of them would), ``sys.argv``, ``sys.path[0]`` the script's directory, then runs the script with
``runpy.run_path`` as ``__main__``. A trial cannot leak state into the next: each is a fresh fork
of the zygote, which runs no trial code itself.

The zygote reaps its children and writes each one's exit status (the wrapper's convention:
128+N for signal N) to its ``exit_file`` before the pid disappears (waitid WNOWAIT), so the
daemon, which watches the child through a pidfd, always finds the status. When the daemon goes
away (its pid ends) or on SIGTERM it stops accepting, waits for its running children, and exits:
a restarted daemon adopts no zygote.

Exit statuses of the zygote itself: 0 stopped; 3 a module failed to import; 4 CUDA was
initialised by an import; 5 threads not known to be fork-safe are running after
the imports. Each with one line on stderr.
"""

from __future__ import annotations

import importlib
import os
import selectors
import signal
import socket
import sys
import time
import warnings
from typing import Any

from det_local.wire import rpc
from det_local.wire.budget import ZYGOTE_REQUEST

PRELOAD_FAILED, CUDA_INITIALISED, THREADS_RUNNING = 3, 4, 5
IDLE_S = 120.0  # a zygote with no request and no trial this long exits (its experiment ended)


def _say(line: str) -> None:
    print(f"det-local zygote: {line}", file=sys.stderr, flush=True)


def preload(modules: list[str]) -> str | None:
    """Import the modules; the one-line reason they cannot be preloaded, or None."""
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as err:  # noqa: BLE001 - any failure means: start trials cold
            why = str(err).splitlines()[0] if str(err) else type(err).__name__
            return f"cannot preload {name}: {why}"
    return None


# Modules a preloaded package imports lazily on first use, which every trial would otherwise
# pay for after the fork: torch.optim.Optimizer() imports torch._dynamo (1-2 s on a CPU box,
# more than `import torch`), and every training script builds an optimizer.
LAZY = {"torch": ("torch._dynamo",)}


def preload_lazy() -> None:
    """Import LAZY's modules of the packages already preloaded. Best effort: one that fails
    (an older torch without it) is left to the trial, which would import it the same way; the
    thread and CUDA checks run after this."""
    for package, modules in LAZY.items():
        if package not in sys.modules:
            continue
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001, S112 - only an optimisation: the trial imports it
                continue


def cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a broken torch is not safe to fork either
        return True


def threads() -> list[str]:
    """The names of this process's threads (/proc/self/task)."""
    names = []
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    return names


# Threads a preload leaves running, by kind, and what the zygote does about each (the reason is
# written once, in sched/warm/zygotes.py's "Threads after the preload"). Told apart by their names
# (/proc/self/task/*/comm), the main thread by its id.
#
# * jemalloc's background thread (``jemalloc_bg_thd``: pyarrow's bundled jemalloc, started when
#   libarrow loads, so by ``import pyarrow``, ``import pandas`` and ``import sklearn``): switched
#   off through jemalloc's own configuration before the preload (JEMALLOC_CONF_VAR, which that
#   jemalloc reads at its initialisation); one still running (another jemalloc, e.g. one in
#   LD_PRELOAD, reading MALLOC_CONF) is tolerated: jemalloc's pthread_atfork handlers hold all
#   its locks across the fork, and its child handler turns background threads off in the child
#   (so a forked trial runs without one either way).
# * OpenBLAS and OpenMP pools (numpy, torch): stopped by their own atfork handlers at the probe
#   fork; one that survives it is not known to be safe.
# * anything else: not known to be safe to fork; the experiment's trials start cold.
JEMALLOC_CONF_VAR = "JE_ARROW_MALLOC_CONF"  # pyarrow's jemalloc (symbol prefix je_arrow_)
JEMALLOC_OFF = "background_thread:false"
FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd"})


def quiet_allocators() -> None:
    """Turn jemalloc's background thread off for what this process loads next, keeping any
    configuration the user gave it (jemalloc reads options left to right: ours wins). Set in
    this process's os.environ only: a forked trial's environment is exactly its plan's."""
    given = os.environ.get(JEMALLOC_CONF_VAR, "")
    os.environ[JEMALLOC_CONF_VAR] = f"{given},{JEMALLOC_OFF}" if given else JEMALLOC_OFF


def extra_threads() -> list[str]:
    """The names of this process's threads other than its main thread."""
    names = []
    me = str(os.getpid())
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    return names


def unsafe_threads() -> list[str]:
    """The threads (names) running now that a fork is not known to be safe with."""
    return [name for name in extra_threads() if name not in FORK_SAFE_THREADS]


def fork() -> int:
    """os.fork, without Python 3.12's warning about forking a multi-threaded process when only
    fork-safe threads (FORK_SAFE_THREADS) run; the child leaves with the parent's filters."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*multi-threaded.*", category=DeprecationWarning)
        return os.fork()


def probe_fork() -> None:
    """Fork once and reap: libraries that keep thread pools (OpenBLAS, loaded by numpy) stop
    them in their pthread_atfork handlers, so what runs after this is what a fork would copy."""
    pid = fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def exit_status(code: int, killed: bool) -> int:
    return 128 + code if killed else code


def write_exit(path: str, status: int) -> None:
    tmp = f"{path}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(f"{status}\n")
        os.replace(tmp, path)
    except OSError as err:
        _say(f"cannot write the exit status of a trial to {path}: {err.strerror}")


def interpreter_added() -> dict[str, str]:
    """What this interpreter added to its own environment at start-up (PEP 538's C locale
    coercion sets LC_CTYPE=C.UTF-8 where no locale is set): the variables of os.environ that
    are not in the environment it was started with (/proc/self/environ, which setenv does not
    change). A fresh interpreter started with a trial's environment adds the same, since the
    trial's differs from the zygote's only in det-local's per-trial variables."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    initial = {item.partition(b"=")[0] for item in raw.split(b"\0") if item}
    return {k: v for k, v in os.environ.items() if os.fsencode(k) not in initial}


class Zygote:
    def __init__(
        self,
        sock_path: str,
        daemon_pid: int,
        daemon_uid: int,
        added: dict[str, str],
        imported: dict[str, str] | None = None,
    ) -> None:
        self.sock_path = sock_path
        self.daemon_uid = daemon_uid
        self.added = added  # interpreter_added(), read before any preload could setenv
        # what the preloaded modules set at import (scikit-learn: KMP_DUPLICATE_LIB_OK and
        # KMP_INIT_AT_FORK, with setdefault): the trial imports them at its top level, which a
        # cold trial's imports would set; the trial's own values win, as setdefault's do
        self.imported = imported or {}
        self.children: dict[int, str] = {}  # pid -> its exit file
        self.accepting = True
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
        try:
            self.daemon_fd: int | None = os.pidfd_open(daemon_pid)
            self.sel.register(self.daemon_fd, selectors.EVENT_READ, "daemon")
        except OSError:
            self.daemon_fd = None  # gone already: serve nothing
            self.accepting = False
        # bound and listening under another name, then renamed into place: the daemon takes
        # the socket's path for "ready" and connects at once, which a socket bound but not
        # yet listening refuses (the daemon then distrusts the zygote: its trials go cold)
        new = f"{sock_path}.new"
        for path in (sock_path, new):
            if os.path.lexists(path):
                os.unlink(path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(new)
        os.chmod(new, 0o600)
        self.listener.listen(16)
        os.rename(new, sock_path)
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")

    def stop(self) -> None:
        if not self.accepting:
            return
        self.accepting = False
        self.sel.unregister(self.listener)
        self.listener.close()
        try:
            os.unlink(self.sock_path)
        except OSError:
            pass

    def serve(self) -> None:
        print(
            f"det-local zygote: ready (pid {os.getpid()}, {len(sys.modules)} modules)", flush=True
        )
        last = time.monotonic()
        while self.accepting or self.children:
            if self.children:
                last = time.monotonic()
            elif time.monotonic() - last > IDLE_S:
                self.stop()
                break
            for key, _ in self.sel.select(timeout=1.0):
                if key.data == "wake":
                    try:
                        os.read(self.wake_r, 512)
                    except BlockingIOError:
                        pass
                elif key.data == "daemon":
                    self.sel.unregister(key.fileobj)
                    self.stop()
                elif key.data == "accept" and self.accepting:
                    last = time.monotonic()
                    self._accept()
            self._reap()

    def _reap(self) -> None:
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None:
                return
            pid = info.si_pid
            killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
            exit_file = self.children.pop(pid, None)
            if exit_file is not None:  # written before the pid goes (the daemon reads it then)
                write_exit(exit_file, exit_status(info.si_status, killed))
            os.waitpid(pid, 0)

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(5.0)
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            uid = int.from_bytes(creds[4:8], sys.byteorder)
            if uid not in (0, self.daemon_uid):
                _say(f"refused a fork request from uid {uid} (only the daemon's is served)")
                return
            try:
                _, fds, _, _ = socket.recv_fds(conn, 1, 1)
                req = rpc.recv(conn, ZYGOTE_REQUEST)
            except (OSError, rpc.FrameError) as err:
                _say(f"a fork request could not be read: {err}")
                return
            if len(fds) != 1 or req is None or req.get("t") != "fork":
                for fd in fds:
                    os.close(fd)
                _say("a fork request without its log descriptor or frame was dropped")
                return
            self._fork(conn, fds[0], req)

    def _fork(self, conn: socket.socket, log_fd: int, req: dict[str, Any]) -> None:
        unsafe = unsafe_threads()
        if unsafe:
            os.close(log_fd)
            said = f"threads not known to be fork-safe are running ({', '.join(unsafe)})"
            rpc.send(conn, {"t": "refused", "error": said})
            return
        pid = fork()
        if pid == 0:
            try:
                code = self._child(conn, log_fd, req)
            except BaseException:  # noqa: BLE001 - never return into the zygote's loop
                code = 125
            os._exit(code)
        os.close(log_fd)
        self.children[pid] = str(req["exit_file"])  # the child answers, once in its session

    def _child(self, conn: socket.socket, log_fd: int, req: dict[str, Any]) -> int:
        # what the zygote holds is not the trial's
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        self.sel.close()
        for fd in (self.wake_r, self.wake_w, self.daemon_fd):
            if fd is not None:
                os.close(fd)
        if self.accepting:
            self.listener.close()
        os.setsid()
        os.umask(int(req["umask"]))
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        rpc.send(conn, {"t": "forked", "pid": os.getpid()})
        go = rpc.recv(
            conn, ZYGOTE_REQUEST
        )  # the daemon has moved this process into the job's cgroup
        conn.close()
        if go is None or go.get("t") != "go":
            return 125
        env = {**self.added, **self.imported, **dict(req["env"])}
        return run(list(req["argv"]), env, str(req["cwd"]))


def run(argv: list[str], env: dict[str, str], cwd: str) -> int:
    """Run ``python argv[1] argv[2:]`` in this process as a fresh interpreter would; its exit
    status."""
    import atexit
    import runpy
    import threading
    import traceback

    try:
        os.chdir(cwd)
    except OSError as err:
        _say(f"cannot enter {cwd}: {err.strerror}")
        return 126
    os.environ.clear()
    # exactly the plan's environment, and PWD, which the shell of a cold start exports
    os.environ.update({**env, "PWD": cwd})
    script = argv[1]
    sys.argv = argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback, status 1
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at exit
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def main(args: list[str]) -> int:
    if len(args) != 4:
        _say("usage: python -m det_local.trial.zygote SOCKET DAEMON_PID DAEMON_UID MODULES")
        return 2
    sock_path, daemon_pid, daemon_uid, modules = args
    # before the preload: what the interpreter itself added, not what an imported module sets
    # (importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR; a cold trial sets it only when
    # it imports that module itself)
    added = interpreter_added()
    quiet_allocators()
    before = dict(os.environ)
    why = preload([m for m in modules.split(",") if m])
    if why is not None:
        _say(f"{why}; this experiment's trials start cold")
        return PRELOAD_FAILED
    # the script's own top-level imports only, not LAZY's (which the trial may never import)
    imported = {k: v for k, v in os.environ.items() if before.get(k) != v}
    preload_lazy()
    if cuda_initialised():
        _say("CUDA was initialised while preloading; this experiment's trials start cold")
        return CUDA_INITIALISED
    probe_fork()
    unsafe = unsafe_threads()
    if unsafe:
        running = threads()
        _say(
            f"{len(running)} threads run after preloading ({', '.join(running)}), "
            f"not known to be safe to fork: {', '.join(unsafe)}; this experiment's trials start "
            "cold"
        )
        return THREADS_RUNNING
    Zygote(sock_path, int(daemon_pid), int(daemon_uid), added, imported).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
