"""Linux inotify through libc, for the spool's two waits that sit on the critical path of every
request: the engine waiting for requests, and a client waiting for its answer.

Both would otherwise poll or go through a watcher thread (watchfiles batches events every few
milliseconds); a request/answer round trip costs several such waits, and `true` jobs submitted
one after another are paced by them. An inotify descriptor is readable the moment a file is
renamed into the directory, so the engine's event loop (``add_reader``) or a client's
``select`` wakes at once, and nothing runs while nothing happens.

``Watch`` raises OSError where inotify is unavailable (not Linux, no libc, watch limits
reached); callers then fall back to what they did before.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import struct
from pathlib import Path

IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_Q_OVERFLOW = 0x00004000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name
_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        # the interpreter's own libc (dlopen(NULL)): ctypes.util.find_library runs
        # `ldconfig -p`, milliseconds that every CLI request waiting for an answer would pay
        lib = ctypes.CDLL(None, use_errno=True)
        if not hasattr(lib, "inotify_init1"):
            from ctypes.util import find_library

            lib = ctypes.CDLL(find_library("c") or "libc.so.6", use_errno=True)
        if not hasattr(lib, "inotify_init1"):
            raise OSError(errno.ENOSYS, "this libc has no inotify")
        lib.inotify_init1.argtypes = [ctypes.c_int]
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        _libc = lib
    return _libc


class Watch:
    """One directory watched for files arriving in it (renamed in, or written and closed)."""

    def __init__(self, directory: Path, mask: int = IN_MOVED_TO | IN_CLOSE_WRITE) -> None:
        lib = _lib()
        fd = lib.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        if lib.inotify_add_watch(fd, os.fsencode(directory), mask | IN_ONLYDIR) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"inotify_add_watch {directory}: {os.strerror(err)}")
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def drain(self) -> list[str]:
        """The names of the files that arrived since the last call (never blocks). An overflow
        of the kernel's event queue is reported as the name "" (look at the whole directory)."""
        names: list[str] = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return names
            except OSError:
                return names
            if not data:
                return names
            at = 0
            while at + _EVENT.size <= len(data):
                _wd, mask, _cookie, length = _EVENT.unpack_from(data, at)
                raw = data[at + _EVENT.size : at + _EVENT.size + length]
                at += _EVENT.size + length
                if mask & IN_Q_OVERFLOW:
                    names.append("")
                else:
                    names.append(os.fsdecode(raw.rstrip(b"\0")))

    def wait(self, timeout: float) -> bool:
        """Block until an event is pending or `timeout` seconds pass; whether one is pending."""
        try:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        except InterruptedError:
            return False
        return bool(ready)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
