"""The dashboard run by the daemon: daemon.yaml's `dashboard:` section, and the service that
keeps `det-local dashboard` running as a child process of the daemon (its own process, so the
daemon's footprint does not change).

```yaml
dashboard:
  port: 8080          # the section turns it on (off without it); 1-65535
  host: 127.0.0.1     # every request needs its token: `det-local dashboard --url` prints
                      # the address with it
  user: nobody        # a daemon run as root runs the dashboard as this user (never as root)
  enabled: true       # false keeps the section but runs no dashboard
```

The child is restarted with a growing delay (1 s, doubling to 60 s; back to 1 s after it ran
a minute) when it exits (when another process holds its port, the daemon's log line names it:
pid, user, command, web/portholder.py, and what to do); it is stopped with the daemon, and it
exits by itself when the daemon dies (even by kill -9): it holds the read end of a pipe whose
write end only the daemon has (`det-local dashboard --exit-with-fd`). Its output goes to
DET_LOCAL_HOME/run/dashboard.log.

Every request carries an access token (web/guard.py), made fresh at each start of the child
and written by the daemon to DET_LOCAL_HOME/run/dashboard.token (`write_token`), which the child
reads before it switches user: under a daemon run as root the file is root's, mode 0644 (every
user of this machine may read it: the dashboard shows only what every user may read, below),
otherwise the daemon's user's alone (0600). `det-local dashboard --url` prints the address with
it. The design: docs/system-mode.md, "Dashboard".

A daemon run as root starts it with `--user USER`: the dashboard binds its port and loads its
code as root, then switches to USER (no supplementary groups) before it serves. USER reads what
every user may read: the database, the queue, the slots (through the spool) and the cluster
view (the cluster socket of a root daemon is open to every user); trial logs private to their
owner (`det-local` keeps them readable only by the owner when the experiment is private) are
not shown, with a one-line reason in the log view.

This module imports no Starlette: the daemon imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from det_local.errors import ConfigError
from det_local.suggest import check_section_keys

if TYPE_CHECKING:
    from det_local.sched.extensions import EngineView, ExtensionFactory

DEFAULT_PORT = 8080
DEFAULT_HOST = "127.0.0.1"
DEFAULT_USER = "nobody"
_KEYS = {"port", "host", "user", "enabled"}
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 60.0
STEADY_S = 60.0  # a child that ran this long starts the delays again from FIRST_DELAY_S
STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class DashboardSettings:
    enabled: bool = False
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    user: str = DEFAULT_USER


def load_dashboard_settings(path: Path) -> DashboardSettings:
    """daemon.yaml's `dashboard:` section (off without one); ConfigError naming the field."""
    if not path.exists():
        return DashboardSettings()
    import yaml

    source = str(path)
    from det_local.config.limits import read_settings_text

    try:
        doc = yaml.safe_load(read_settings_text(path)) or {}
    except yaml.YAMLError:
        raise ConfigError(f"{source} is not valid YAML") from None
    raw = doc.get("dashboard") if isinstance(doc, dict) else None
    if raw is None:
        return DashboardSettings()
    if not isinstance(raw, dict):
        raise ConfigError(
            f"dashboard in {source}: expected a mapping such as {{port: {DEFAULT_PORT}}}, "
            f"found {raw!r}"
        )
    check_section_keys("dashboard.", raw, _KEYS, source)
    port = raw.get("port", DEFAULT_PORT)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(
            f"dashboard.port in {source}: expected a port number 1-65535, found {port!r}"
        )
    host = raw.get("host", DEFAULT_HOST)
    if not isinstance(host, str) or not host.strip():
        raise ConfigError(
            f"dashboard.host in {source}: expected an address such as 127.0.0.1, found {host!r}"
        )
    user = raw.get("user", DEFAULT_USER)
    if not isinstance(user, str) or not user.strip():
        raise ConfigError(f"dashboard.user in {source}: expected a user name, found {user!r}")
    if os.geteuid() == 0:
        check_user(user, f"dashboard.user in {source}")
    enabled = raw.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(
            f"dashboard.enabled in {source}: expected true or false, found {enabled!r}"
        )
    return DashboardSettings(enabled=enabled, host=host.strip(), port=port, user=user.strip())


def check_user(user: str, where: str) -> tuple[int, int]:
    """(uid, gid) of the unprivileged user the dashboard runs as; ConfigError for root or a
    user this machine lacks."""
    import pwd

    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise ConfigError(
            f"{where}: no user {user!r} on this machine; name an existing unprivileged user "
            f"(default {DEFAULT_USER})"
        ) from None
    if pw.pw_uid == 0:
        raise ConfigError(
            f"{where}: the dashboard must not run as root ({user!r}); name an unprivileged user "
            f"(default {DEFAULT_USER})"
        )
    return pw.pw_uid, pw.pw_gid


def child_argv(settings: DashboardSettings, exit_fd: int, token_file: Path) -> list[str]:
    argv = [sys.executable, "-m", "det_local.cli.main", "dashboard"]
    argv += ["--host", settings.host, "--port", str(settings.port), "--exit-with-fd", str(exit_fd)]
    argv += ["--token-file", str(token_file)]
    if os.geteuid() == 0:
        argv += ["--user", settings.user]
    return argv


class DashboardChild:
    """The daemon's service keeping the dashboard running (an Extension: start/stop)."""

    def __init__(self, view: EngineView, settings: DashboardSettings) -> None:
        self.view = view
        self.settings = settings
        self.proc: asyncio.subprocess.Process | None = None
        self.task: asyncio.Task[None] | None = None
        self.stopping = False
        self.pipe: tuple[int, int] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.view.paths.dashboard_log

    @property
    def token_path(self) -> Path:
        return token_path(self.view.paths.run_dir)

    async def start(self) -> None:
        self.pipe = os.pipe()  # the child's read end reaches EOF when this process ends
        self.task = asyncio.get_running_loop().create_task(self._keep_running())

    async def _spawn(self) -> asyncio.subprocess.Process:
        assert self.pipe is not None
        read_end = self.pipe[0]
        env = {**os.environ, "DET_LOCAL_HOME": str(self.view.paths.home)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        write_token(self.token_path)
        with open(self.log_path, "ab") as log:
            os.chmod(self.log_path, 0o600)
            return await asyncio.create_subprocess_exec(
                *child_argv(self.settings, read_end, self.token_path),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=(read_end,),
                start_new_session=True,
                env=env,
                cwd="/",
            )

    async def _keep_running(self) -> None:
        delay = FIRST_DELAY_S
        while not self.stopping:
            began = time.monotonic()
            try:
                self.proc = await self._spawn()
            except OSError as err:
                self.view.log(f"cannot start the dashboard: {err}")
                code: int | None = None
            else:
                self.starts += 1
                self.view.log(
                    f"dashboard {self.proc.pid} on {self.settings.host}:"
                    f"{self.settings.port} (its output: {self.log_path})"
                )
                code = await self.proc.wait()
            if self.stopping:
                return
            if time.monotonic() - began >= STEADY_S:
                delay = FIRST_DELAY_S
            self.view.log(await self._exited(code, delay))
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_DELAY_S)

    async def _exited(self, code: int | None, delay: float) -> str:
        """The line saying the child ended: when another process listens on the dashboard's
        port, who (pid, user, command) and what to do (read off the loop: /proc)."""
        from det_local.web.portholder import held_by

        host, port = self.settings.host, self.settings.port
        held = await asyncio.to_thread(held_by, port, host) if code else ""
        if held:
            return (
                f"the dashboard cannot listen on {host}:{port}: {held}; stop that "
                f"process (or set dashboard.port in {self.view.paths.settings} and restart the "
                f"daemon); retrying in {delay:.0f}s"
            )
        return f"the dashboard exited ({code}); restarting in {delay:.0f}s (see {self.log_path})"

    async def stop(self) -> None:
        self.stopping = True
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        with contextlib.suppress(OSError):
            self.token_path.unlink()
        if self.pipe is not None:
            for fd in self.pipe:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.pipe = None


TOKEN_FILE = "dashboard.token"


def token_path(run_dir: Path) -> Path:
    return run_dir / TOKEN_FILE


def write_token(path: Path) -> str:
    """A fresh access token for the dashboard, in `path` (replaced whole, never readable half
    written): 0644 when this process is root (every user may read what that dashboard shows),
    else 0600."""
    import secrets

    token = secrets.token_urlsafe(24)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, token.encode() + b"\n")
        os.fchmod(fd, 0o644 if os.geteuid() == 0 else 0o600)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token


def extension(settings: DashboardSettings) -> ExtensionFactory:
    """The factory `det-local daemon` hands run_foreground when the section is on."""

    def make(view: EngineView) -> Any:
        return DashboardChild(view, settings)

    return make


# ---------------------------------------------------------------------------- the child's side
def exit_with(fd: int) -> None:
    """In the dashboard: end this process (SIGTERM, a clean stop) once `fd` reaches EOF, i.e.
    when the daemon holding its write end has gone, however it went."""
    import signal
    import threading

    def wait() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 1):
                pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="exit-with-daemon", daemon=True).start()


def drop_to(user: str) -> None:
    """In the dashboard, started as root: become `user` (its group, no others) for good."""
    uid, gid = check_user(user, "--user")
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
