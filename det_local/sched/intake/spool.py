"""The spool: submissions and control requests as files in DET_LOCAL_HOME/queue.

A client writes ``queue/<time_ns>-<pid>-<random>.req`` atomically (a hidden temporary file, then
a rename), so file names sort in the order the daemon applies them and `ls queue/` shows what
is pending. The daemon reads each request, checks that the user it claims is the file's owner
(kernel-verified: a user cannot forge another's uid on a file they create), applies it,
commits the result and writes ``queue/responses/<id>.resp``, and only then removes the request:
after a crash a request is either applied (its result is in the store, replayed) or still here.
"""

from __future__ import annotations

import os
import pwd
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from det_local.errors import DetLocalError
from det_local.store.paths import Paths
from det_local.store.safe_open import UnsafeFile, read_bounded_stat
from det_local.wire.budget import SPOOL_ANSWER, SPOOL_REQUEST, Refused, decode, scan

SUFFIX = ".req"
RESPONSE_SUFFIX = ".resp"
MAX_REQUEST_BYTES = SPOOL_REQUEST.max_bytes  # 4 MiB
MAX_REQUEST_DEPTH = SPOOL_REQUEST.max_depth  # 100 (a config in a request: limits.MAX_DEPTH)


class SpoolError(DetLocalError):
    """A request file the daemon cannot use (malformed, truncated, forged)."""


class NoAnswer(DetLocalError):
    """No answer came within the time asked for."""


@dataclass(frozen=True)
class Request:
    id: str
    op: str
    user: str
    uid: int
    payload: dict[str, Any]
    path: Path


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def responses_dir(paths: Paths) -> Path:
    return paths.queue / "responses"


# ---------------------------------------------------------------------- client side
def submit(paths: Paths, op: str, payload: dict[str, Any], durable: bool = True) -> str:
    """Write a request; returns its id (the file name without the suffix).

    durable=False skips the fsync: for a requester that waits for the answer, which comes only
    once the request is committed in the store, so nothing was promised before that point (a
    requester that gives up waiting calls `make_durable` before saying the request is queued)."""
    paths.queue.mkdir(parents=True, exist_ok=True)
    req_id = f"{time.time_ns():020d}-{os.getpid()}-{os.urandom(4).hex()}"  # as secrets.token_hex
    try:
        body = msgpack.packb(
            {"op": op, "user": user_name(os.geteuid()), "payload": payload}, use_bin_type=True
        )
    except OverflowError:  # a number past 64 bits (the CLI checks its options' ranges first)
        raise SpoolError(
            f"a number in the {op} request is too large to send (more than 64 bits); nothing "
            "was submitted: check the numbers given"
        ) from None
    tmp = paths.queue / f".{req_id}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, paths.queue / f"{req_id}{SUFFIX}")
    except OSError as err:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise SpoolError(
            f"cannot write a request to {paths.queue}: {err.strerror or err}; nothing was "
            "submitted (free some space there, or check its permissions, and try again)"
        ) from None
    return req_id


def make_durable(paths: Paths, req_id: str) -> None:
    """fsync a request still in the spool (written with durable=False), and the spool itself."""
    for target in (paths.queue / f"{req_id}{SUFFIX}", paths.queue):
        try:
            fd = os.open(target, os.O_RDONLY)
        except OSError:
            continue  # taken meanwhile: its answer is in the store
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)


class AnswerWatch:
    """What a requester waits on: an inotify watch of the responses directory, made before
    the request is written so no answer can slip by; polling where inotify is unavailable.

    Closing an inotify descriptor waits for an RCU grace period (milliseconds), so a process
    keeps one per spool (`answer_watch`) for all its requests instead of one per request."""

    def __init__(self, paths: Paths) -> None:
        from det_local.sched.intake import inotify

        self.watch: inotify.Watch | None
        try:
            self.watch = inotify.Watch(responses_dir(paths))
        except OSError:  # no responses directory yet (a daemon creates it), or no inotify
            self.watch = None
        self.delay = 0.0005

    def pause(self, deadline: float) -> None:
        """Wait for something to arrive (or a short while), at most until the deadline."""
        left = deadline - time.monotonic()
        if left <= 0:
            return
        if self.watch is not None:
            # bounded anyway: an event missed (the directory replaced) costs 50 ms, not a hang
            if self.watch.wait(min(left, 0.05)):
                self.watch.drain()
            return
        time.sleep(min(self.delay, left))
        self.delay = min(self.delay * 1.5, 0.005)


_WATCHES: dict[Path, AnswerWatch] = {}


def answer_watch(paths: Paths) -> AnswerWatch:
    """This process's watch of the spool's answers (made once, kept until the process ends)."""
    watch = _WATCHES.get(paths.queue)
    if watch is None or watch.watch is None:
        watch = AnswerWatch(paths)
        _WATCHES[paths.queue] = watch
    return watch


def wait_response(
    paths: Paths, req_id: str, timeout: float = 60.0, watch: AnswerWatch | None = None
) -> Any:
    """Wait (inotify, else polling from 0.5 ms rising to 5 ms) for the daemon's answer."""
    path = responses_dir(paths) / f"{req_id}{RESPONSE_SUFFIX}"
    daemon_uid = os.stat(paths.queue).st_uid  # answers are written by the queue's owner only
    deadline = time.monotonic() + timeout
    if watch is None:
        watch = answer_watch(paths)
    while True:
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_uid != daemon_uid:
                    raise DetLocalError(
                        f"the answer to request {req_id} is not owned by the det-local "
                        f"daemon's user; someone tampered with {path.parent}"
                    )
                data = f.read()
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise NoAnswer(
                    f"the det-local daemon did not answer request {req_id} in {timeout:.0f}s; "
                    "is it running? (`det-local daemon status`)"
                ) from None
            watch.pause(deadline)
            continue
        break
    try:
        path.unlink()
    except OSError:
        pass
    try:
        answer = decode(data, SPOOL_ANSWER)
    except Refused as err:
        raise DetLocalError(f"the answer to request {req_id} is unusable ({err})") from None
    if not isinstance(answer, dict):
        raise DetLocalError(f"the answer to request {req_id} is unusable (not a map)")
    if answer.get("error"):
        raise DetLocalError(str(answer["error"]))
    return answer.get("value")


def request(paths: Paths, op: str, payload: dict[str, Any], timeout: float = 60.0) -> Any:
    watch = answer_watch(paths)  # before the request: its answer cannot slip by
    return wait_response(paths, submit(paths, op, payload), timeout, watch)


# ---------------------------------------------------------------------- daemon side
def pending(paths: Paths) -> list[Path]:
    """Request files in the order they are applied."""
    try:
        names = sorted(n for n in os.listdir(paths.queue) if n.endswith(SUFFIX))
    except FileNotFoundError:
        return []
    return [paths.queue / n for n in names]


def _look(head: bytes, size: int) -> None:
    scan(head, SPOOL_REQUEST, total=size)


def read(path: Path) -> Request:
    """Parse a request file; SpoolError (one line, naming the file) when it is unusable.

    The file is opened once, without following a symlink and without blocking (a FIFO swapped
    in for the file cannot hang the daemon); that descriptor is what is checked (a regular file,
    at most MAX_REQUEST_BYTES) and read, and its owner is who made the request."""
    req_id = path.name[: -len(SUFFIX)]
    try:
        data, st = read_bounded_stat(
            path, MAX_REQUEST_BYTES, what="request", name=path.name, check_prefix=_look
        )
    except FileNotFoundError:
        raise SpoolError(f"request {path.name} vanished before it was read") from None
    except Refused as err:  # its first bytes already show a bomb: the rest is never read
        raise SpoolError(
            f"request {path.name} refused: {err}; submit it with the det-local CLI"
        ) from None
    except UnsafeFile as err:
        if err.reason == "symlink":
            raise SpoolError(
                f"request {path.name} is not a regular file (a symbolic link); refusing to "
                "follow it (submit requests with the det-local CLI)"
            ) from None
        if err.reason == "not_regular":
            raise SpoolError(
                f"request {path.name} is not a regular file; refusing to read it "
                "(submit requests with the det-local CLI)"
            ) from None
        raise SpoolError(str(err)) from None
    try:
        # budgeted: a bomb (4 MiB of nested empty maps, a 4 GiB length, 100,000 levels) is
        # refused in milliseconds, before anything is built
        body = decode(data, SPOOL_REQUEST)
    except Refused as err:
        raise SpoolError(
            f"request {path.name} refused: {err}; submit it with the det-local CLI"
        ) from None
    if not isinstance(body, dict) or not isinstance(body.get("op"), str):
        raise SpoolError(f"request {path.name} has no operation; submit it with the det-local CLI")
    owner = user_name(st.st_uid)
    claimed = body.get("user")
    if claimed != owner:
        raise SpoolError(
            f"request {path.name} claims user {claimed!r} but its file is owned by {owner!r}; "
            "requests are made as the user who writes them"
        )
    payload = body.get("payload") or {}
    if not isinstance(payload, dict):
        raise SpoolError(f"request {path.name}: payload is not a map")
    return Request(req_id, body["op"], owner, st.st_uid, payload, path)


def respond(paths: Paths, req_id: str, uid: int, answer: dict[str, Any]) -> None:
    """Write the answer where the requester waits for it. Answers name only ids and messages;
    they are owned by the daemon's user, which is how clients know them genuine."""
    out = responses_dir(paths)
    tmp = out / f".{req_id}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o644)
    except FileNotFoundError:  # the directory went (or never was): make it, once
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, flags, 0o644)
    try:
        os.fchmod(fd, 0o644)  # readable by the requester whatever the daemon's umask
        data = memoryview(msgpack.packb(answer, use_bin_type=True))
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)
    os.replace(tmp, out / f"{req_id}{RESPONSE_SUFFIX}")


def prune_responses(paths: Paths, max_age_s: float = 3600.0) -> int:
    """Remove answers nobody collected (their requester went away)."""
    now = time.time()
    n = 0
    try:
        entries = list(os.scandir(responses_dir(paths)))
    except FileNotFoundError:
        return 0
    for e in entries:
        try:
            if now - e.stat().st_mtime > max_age_s:
                os.unlink(e.path)
                n += 1
        except OSError:
            pass
    return n


def remove(path: Path) -> None:
    """Remove a request (or whatever took a request's name: a directory goes too)."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        import shutil

        shutil.rmtree(path, ignore_errors=True)  # never follows symlinks inside it
        if path.exists():  # out of the way, at least: a hidden name is not a request
            os.rename(path, path.with_name(f".{path.name}.rejected"))
