"""Reading files that another user may control, from a daemon that runs as root.

A root daemon must not follow a user's symlink (to /dev/zero, /etc/shadow), block on a FIFO
swapped in between a check and the open, or read an unbounded amount. ``read_bounded`` opens
with O_NOFOLLOW|O_NONBLOCK, checks the descriptor it got (not the name) with fstat: a regular
file, optionally of an expected owner, no larger than the bound; then reads at most that many
bytes. Anything else is an ``UnsafeFile`` error with one line naming the file and the reason.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from det_local.errors import DetLocalError

PREFIX_BYTES = 64 * 1024  # what read_bounded_stat's check_prefix sees
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)


class UnsafeFile(DetLocalError):
    """A file in a user-writable place that the daemon refuses to read. ``reason``: symlink,
    not_regular, owner, size, open or (read_bounded_in) outside."""

    def __init__(self, message: str, reason: str = "open") -> None:
        super().__init__(message)
        self.reason = reason


def read_bounded(
    path: str | os.PathLike[str],
    max_bytes: int,
    *,
    owner: int | None = None,
    what: str = "file",
) -> bytes:
    """The contents of a regular file of at most ``max_bytes`` bytes (owned by ``owner`` when
    given). FileNotFoundError passes through unchanged, so callers can treat "absent" apart."""
    return read_bounded_stat(path, max_bytes, owner=owner, what=what)[0]


def read_bounded_stat(
    path: str | os.PathLike[str],
    max_bytes: int,
    *,
    owner: int | None = None,
    what: str = "file",
    name: str | None = None,
    check_prefix: Callable[[bytes, int], None] | None = None,
) -> tuple[bytes, os.stat_result]:
    """``read_bounded``, with the fstat of the descriptor that was read: who owns what was
    read comes from the same descriptor, never from a second look at the name (which another
    user may have swapped meanwhile). ``name`` is how messages name the file (its path when
    not given). ``UnsafeFile.reason`` says why a file was refused. ``check_prefix(head, size)``:
    called with the first PREFIX_BYTES of a larger file before the rest is read."""
    shown = Path(path) if name is None else name
    try:
        fd = os.open(path, _FLAGS)
    except OSError as err:
        if isinstance(err, FileNotFoundError):
            raise
        if err.errno == errno.ELOOP:  # the last component is a symlink (O_NOFOLLOW)
            raise UnsafeFile(
                f"{what} {shown} is a symbolic link; refusing to follow it", "symlink"
            ) from None
        raise UnsafeFile(f"{what} {shown} cannot be opened: {err.strerror}", "open") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(
                f"{what} {shown} is not a regular file; refusing to read it", "not_regular"
            )
        if owner is not None and st.st_uid != owner and st.st_uid != 0:
            raise UnsafeFile(
                f"{what} {shown} is owned by uid {st.st_uid}, expected uid {owner}; refusing it",
                "owner",
            )
        if st.st_size > max_bytes:
            raise UnsafeFile(
                f"{what} {shown} is {st.st_size} bytes, over the {max_bytes}-byte limit", "size"
            )
        chunks: list[bytes] = []
        left = max_bytes + 1  # one more than allowed: a file that grew meanwhile is caught
        if check_prefix is not None and st.st_size > PREFIX_BYTES:
            # a look at the start first (a decoding bomb shows itself there): whatever it
            # raises ends the read before the rest is read
            head = os.read(fd, PREFIX_BYTES)
            check_prefix(head, st.st_size)
            chunks.append(head)
            left -= len(head)
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            raise UnsafeFile(
                f"{what} {shown} grew past the {max_bytes}-byte limit while read", "size"
            )
        return data, st
    finally:
        os.close(fd)


_DIR_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC


def read_bounded_in(
    root: str | os.PathLike[str],
    rel: str,
    max_bytes: int,
    *,
    owner: int | None = None,
    what: str = "file",
) -> bytes:
    """``read_bounded`` of ``rel`` inside the directory ``root``, where the tree may be another
    user's (a context snapshot their trials run from): ``rel`` must be relative and stay inside
    (no ``..``); every directory on the way is opened relative to the one before it without
    following a symlink, so nothing the user swaps in leads outside ``root``. ``owner``: the
    file must be that uid's or readable by everyone (what that user could read anyway: a
    root-only file hard-linked into the tree is refused). UnsafeFile
    (one line; ``reason``: outside, symlink, not_regular, owner, size, open) otherwise;
    FileNotFoundError, unchanged, when it (or a directory on the way) does not exist."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if rel.startswith("/") or not parts or ".." in parts:
        raise UnsafeFile(f"{what} {rel} is not a path inside {root}", "outside")
    try:
        dirfd = os.open(root, _DIR_FLAGS)
    except OSError as err:
        raise UnsafeFile(f"{what} {rel}: cannot open {root}: {err.strerror}", "open") from None
    try:
        for i, part in enumerate(parts[:-1]):
            try:
                nextfd = os.open(part, _DIR_FLAGS, dir_fd=dirfd)
            except OSError as err:
                if isinstance(err, FileNotFoundError):
                    raise
                where = "/".join(parts[: i + 1])
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeFile(
                        f"{what} {rel}: {where} is not a directory of {root} (a symbolic link "
                        "or a file); refusing to follow it",
                        "symlink",
                    ) from None
                raise UnsafeFile(f"{what} {rel}: cannot open {where}: {err.strerror}") from None
            os.close(dirfd)
            dirfd = nextfd
        try:
            fd = os.open(parts[-1], _FLAGS, dir_fd=dirfd)
        except OSError as err:
            if isinstance(err, FileNotFoundError):
                raise
            if err.errno == errno.ELOOP:
                raise UnsafeFile(
                    f"{what} {rel} is a symbolic link; refusing to follow it", "symlink"
                ) from None
            raise UnsafeFile(f"{what} {rel} cannot be opened: {err.strerror}", "open") from None
    finally:
        os.close(dirfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(
                f"{what} {rel} is not a regular file; refusing to read it", "not_regular"
            )
        if owner is not None and st.st_uid != owner and not st.st_mode & stat.S_IROTH:
            raise UnsafeFile(
                f"{what} {rel} is owned by uid {st.st_uid}, not by uid {owner}, and others may "
                "not read it; refusing it",
                "owner",
            )
        if st.st_size > max_bytes:
            raise UnsafeFile(
                f"{what} {rel} is {st.st_size} bytes, over the {max_bytes}-byte limit", "size"
            )
        data = os.read(fd, max_bytes + 1)  # one more: a file that grew meanwhile is caught
        while len(data) <= max_bytes:
            more = os.read(fd, max_bytes + 1 - len(data))
            if not more:
                break
            data += more
        if len(data) > max_bytes:
            raise UnsafeFile(
                f"{what} {rel} grew past the {max_bytes}-byte limit while read", "size"
            )
        return data
    finally:
        os.close(fd)
