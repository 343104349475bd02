"""What a daemon believes of a zygote (`sched/warm/zygotes.py`): nothing it has not checked.

A zygote runs as its trial's user, who owns it: they can trace it, replace its code, or put any
program of theirs on its socket. So everything that comes from a zygote is untrusted input to
the daemon (root, for a whole lab), which acts on it only once the kernel has confirmed it:

- **Its socket** is opened without following a symbolic link (``O_PATH|O_NOFOLLOW``), must be
  a socket owned by the trial's user, and is connected through that descriptor
  (``/proc/self/fd/N``): the user cannot point root at another user's zygote or any other
  socket. The listener at the other end (``SO_PEERCRED``) must run as the trial's user and be
  the child of the zygote's wrapper (root's, the daemon's own child): the zygote it started,
  nothing else of that user's.
- **Its answers** are read with one deadline for the whole exchange (a silent or trickling
  zygote cannot hold the daemon longer), in frames of at most :data:`ANSWER_MAX` bytes, and
  must have exactly the expected shape.
- **The pid it answers** is opened first (``pidfd_open``), then checked in /proc: a child of
  that zygote (PPid), running as the trial's user and group (real, effective, saved and
  filesystem ids), leading its own session (it called setsid). The check holds for the process
  the descriptor names only if that process is still alive after the check (a pidfd becomes
  readable once its process ended), which is checked last. Only then does the daemon write the
  pid into the job's cgroup, and it checks again afterwards that the process is still alive
  (so the pid named it during the write); every signal before that goes through the pidfd.
  What is left is a window of two system calls (the last check, the write), in which the
  user would have to end the process, have the zygote reap it, and have the kernel hand its
  pid to another process, the pid allocator having gone round all of pid_max; the check after
  the write then sees it ended and the trial starts cold.

:class:`Untrusted` carries one line: what the zygote did, for the daemon's event log.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_local.wire import rpc
from det_local.wire.budget import ZYGOTE_REPLY

ANSWER_MAX = 4096  # a zygote's answer ({t: forked, pid}) is a few bytes


class Untrusted(Exception):
    """A zygote said or did something the daemon will not act on (one line)."""


@dataclass(frozen=True)
class Ids:
    """The ids a trial (and its zygote) runs with."""

    uid: int
    gid: int


def expected_ids(uid: int | None, gid: int | None) -> Ids:
    """The ids of a plan's processes: its user's where a root daemon drops to them (as
    `executor.spawn` does), else the daemon's own."""
    if uid is not None and uid != 0 and os.geteuid() == 0:
        return Ids(uid, gid if gid is not None else uid)
    return Ids(os.geteuid(), os.getegid())


@dataclass(frozen=True)
class ProcStatus:
    ppid: int
    uids: tuple[int, ...]  # real, effective, saved, filesystem
    gids: tuple[int, ...]
    pgid: int
    sid: int


def read_status(pid: int) -> ProcStatus:
    """A process's parent, ids, process group and session from /proc (OSError when it is
    gone). The name, which the process sets itself, is escaped in status and parenthesised in
    stat: only the fields after it are read."""
    with open(f"/proc/{pid}/status", "rb") as f:
        status = f.read()
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat_line = f.read()
    fields: dict[bytes, list[int]] = {}
    for line in status.splitlines():
        key, _, value = line.partition(b":")
        if key in (b"PPid", b"Uid", b"Gid") and key not in fields:
            fields[key] = [int(x) for x in value.split()]
    after = stat_line[stat_line.rindex(b")") + 2 :].split()
    return ProcStatus(
        fields[b"PPid"][0],
        tuple(fields[b"Uid"]),
        tuple(fields[b"Gid"]),
        int(after[2]),
        int(after[3]),
    )


def alive(pidfd: int) -> bool:
    """Whether the process a pidfd names has not ended (the pidfd is readable once it has)."""
    ready, _, _ = select.select([pidfd], [], [], 0)
    return not ready


def _owned_by(st: ProcStatus, ids: Ids, *, gid: bool = True) -> bool:
    return set(st.uids) == {ids.uid} and (not gid or set(st.gids) == {ids.gid})


def connect(path: Path, ids: Ids, deadline: float) -> socket.socket:
    """A connection to the zygote's socket at `path`: a socket owned by the trial's user,
    never reached through a symbolic link."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise Untrusted(f"its socket {path} cannot be opened: {err.strerror}") from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode):
            raise Untrusted(f"{path} is not a socket (a symbolic link or another file)")
        if st.st_uid != ids.uid:
            raise Untrusted(f"its socket {path} is owned by uid {st.st_uid}, not {ids.uid}")
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.connect(f"/proc/self/fd/{fd}")
    except OSError as err:
        sock.close()
        raise Untrusted(f"its socket {path} refused the connection: {_why(err)}") from None
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(fd)
    return sock


def check_listener(sock: socket.socket, wrapper_pid: int, ids: Ids) -> int:
    """The pid of the process listening on the zygote's socket, once it is the child of the
    zygote's wrapper and runs as the trial's user."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    if uid != ids.uid:
        raise Untrusted(f"its socket is served by uid {uid}, not {ids.uid}")
    fd = _pidfd(pid, "the process serving its socket")
    try:
        st = _status(pid, "the process serving its socket")
        if st.ppid != wrapper_pid or not _owned_by(st, ids, gid=False) or not alive(fd):
            raise Untrusted(
                f"its socket is served by pid {pid}, which is not the zygote det-local started "
                f"(the child of its wrapper {wrapper_pid}, running as uid {ids.uid})"
            )
    finally:
        os.close(fd)
    return pid


def recv_answer(sock: socket.socket, deadline: float) -> dict[str, Any]:
    """One frame from the zygote, read by the deadline; Untrusted for anything else."""
    head = _recv_exact(sock, rpc.HEADER.size, deadline)
    (size,) = rpc.HEADER.unpack(head)
    if size > ANSWER_MAX:
        raise Untrusted(f"it answered a frame of {size} bytes (at most {ANSWER_MAX})")
    body = _recv_exact(sock, size, deadline)
    try:
        answer = rpc.unpack(body, ZYGOTE_REPLY)
    except rpc.FrameError as err:
        raise Untrusted(f"it answered garbage ({err})") from None
    if not isinstance(answer, dict):
        raise Untrusted("it answered garbage (not a message)")
    return answer


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Untrusted("it did not answer in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise Untrusted("it did not answer in time") from None
        except OSError as err:
            raise Untrusted(f"its connection failed: {_why(err)}") from None
        if not chunk:
            raise Untrusted("it closed the connection without an answer")
        buf += chunk
    return bytes(buf)


def forked_pid(answer: dict[str, Any]) -> int:
    pid = answer.get("pid")
    if answer.get("t") != "forked" or type(pid) is not int or pid <= 1:
        raise Untrusted(f"it answered {_short(answer)}, not a forked process's pid")
    return pid


def open_child(pid: int, zygote_pid: int, ids: Ids) -> int:
    """A pidfd of the trial the zygote forked, once it is that zygote's child, runs as the
    trial's user and group and leads its own session; Untrusted otherwise (nothing was done to
    the process)."""
    fd = _pidfd(pid, f"pid {pid}")
    try:
        st = _status(pid, f"pid {pid}")
        why = None
        if st.ppid != zygote_pid:
            why = f"its parent is {st.ppid}, not the zygote ({zygote_pid})"
        elif not _owned_by(st, ids):
            why = f"it runs as uids {st.uids} gids {st.gids}, not as {ids.uid}:{ids.gid}"
        elif not st.pgid == st.sid == pid:
            why = "it does not lead its own session"
        elif not alive(fd):
            why = "it ended while being checked"
        if why is not None:
            raise Untrusted(f"it answered pid {pid}, which is not a trial it forked: {why}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pidfd(pid: int, what: str) -> int:
    try:
        return os.pidfd_open(pid)
    except OSError as err:
        raise Untrusted(f"{what} cannot be opened: {_why(err)}") from None


def _status(pid: int, what: str) -> ProcStatus:
    try:
        return read_status(pid)
    except (OSError, ValueError, KeyError, IndexError):
        raise Untrusted(f"{what} cannot be read in /proc (it ended)") from None


def _why(err: OSError) -> str:
    return err.strerror or errno.errorcode.get(err.errno or 0, str(err))


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
