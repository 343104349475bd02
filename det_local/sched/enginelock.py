"""One engine per home: the flock on run/engine.lock that whichever process runs this home's engine
holds (the daemon, or a `det-local run` with no daemon), and the probe any user may make of it.
Light on purpose: clients import it to ask whether an engine runs, without asyncio or the engine."""

from __future__ import annotations

import fcntl
import os

from det_local.errors import DetLocalError
from det_local.store.paths import Paths


class EngineLock:
    """An flock on run/engine.lock: held by whichever process runs this home's engine."""

    def __init__(self, paths: Paths) -> None:
        self.home = paths.home
        self.path = paths.run_dir / "engine.lock"
        self.writable = True
        try:
            paths.ensure()
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:
            # system mode: the home is root's; other users only ever talk to its daemon
            self.writable = False
            try:
                self.fd = os.open(self.path, os.O_RDONLY)
            except OSError:
                self.fd = -1

    def try_acquire(self) -> bool:
        if not self.writable:
            if self.fd >= 0 and not lock_free_fd(self.fd):
                return False  # its daemon runs: send it the request
            raise DetLocalError(
                f"no det-local daemon is running for {self.home}, and its files belong to "
                "another user (a shared, system-mode home): ask its administrator to start "
                "it (`det-local daemon start` as root), or use a DET_LOCAL_HOME of your own"
            )
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"{os.getpid()}\n".encode())
        return True

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def lock_free(paths: Paths) -> bool:
    """Whether no process runs this home's engine right now (any user may ask: the probe
    needs only read access to the lock file, which a system-mode home gives everyone)."""
    try:
        fd = os.open(paths.run_dir / "engine.lock", os.O_RDONLY)
    except FileNotFoundError:
        return True  # no engine has ever run here
    try:
        return lock_free_fd(fd)
    finally:
        os.close(fd)


def lock_free_fd(fd: int) -> bool:
    """Whether nobody holds the engine lock open as `fd` (a shared probe, released at once:
    it needs only read access, so any user can tell whether the daemon runs). Light (no asyncio), so
    that a CLI request can ask."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True
