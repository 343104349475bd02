"""Files a root daemon creates for a user's job: owned by that user, with the user's umask.

A job runs as its submitter with the umask the submitter's client had (captured at
submission, stored with the job), as if they had run it themselves. What the daemon creates for
the job (its log file, its run directory, a checkpoint directory made for it) is created owned
by the user, with a mode derived from that umask, so that a user with umask 077 keeps them
private. The daemon never makes such a file more open than 0644 (directories 0755) nor hides it
from its owner: ``file_mode``/``dir_mode`` apply the umask's group/other read bits only.

Admins still read them: root always can, and the admin group (settings.admin_group) gets a
POSIX ACL entry ``group:<admin_group>:r`` (``r-x`` on directories) on whatever the umask hides
from others. The entry is written directly as the ``system.posix_acl_access`` attribute (no
setfacl needed); on a filesystem without ACLs the file's group becomes the admin group instead
(group bits ``r``/``r-x``).
"""

from __future__ import annotations

import errno
import grp
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_local.errors import DetLocalError, TrialError
from det_local.store.acl import grant_admin

DEFAULT_UMASK = 0o022  # what a job gets when its submission carries none (an older client)
_KEEP_CLOSED = 0o022  # the daemon never makes a user's file group- or other-writable


class BadUmask(DetLocalError):
    pass


def current_umask() -> int:
    """This process's umask (the client's, sent with a submission), read without changing it
    (/proc/self/status); where that is unavailable, set and put back."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8) & 0o777
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(DEFAULT_UMASK)
    os.umask(mask)
    return mask & 0o777


def check_umask(value: Any) -> int:
    """A submission's umask (user input): a whole number from 0 to 0o777; absent: 0o022."""
    if value is None:
        return DEFAULT_UMASK
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0o777:
        raise BadUmask(
            f"umask {value!r} is not a file mode mask: give a whole number from 0 to 0o777 "
            "(e.g. 0o022, or 0o077 to keep your files private)"
        )
    return value


def file_mode(umask: int) -> int:
    """Mode of a file the daemon makes for a user: 0644 less what the umask hides from group and
    others (owner read/write always)."""
    return 0o666 & ~((umask | _KEEP_CLOSED) & 0o077)


def dir_mode(umask: int) -> int:
    return 0o777 & ~((umask | _KEEP_CLOSED) & 0o077)


@dataclass(frozen=True)
class Owner:
    """Whom a job's files belong to (system mode): ids, umask, and the admin group's gid."""

    uid: int
    gid: int
    umask: int = DEFAULT_UMASK
    admin_gid: int | None = None


def admin_gid(group: str) -> int | None:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        return None


def owner_of(plan: Any) -> Owner | None:
    """The Owner of a LaunchPlan's files when a root daemon runs it for another user."""
    uid = getattr(plan, "uid", None)
    if uid is None or uid == 0 or os.geteuid() != 0:
        return None
    gid = plan.gid if plan.gid is not None else uid
    umask = plan.umask if plan.umask is not None else DEFAULT_UMASK
    return Owner(uid, gid, umask, plan.admin_gid)


def owner_for(identity: dict[str, Any], umask: int | None, admin_group: str) -> Owner | None:
    """The Owner of a job's files from its identity (queue._identity: empty unless a root
    daemon runs the job for another user)."""
    if not identity:
        return None
    return Owner(
        identity["uid"],
        identity.get("gid", identity["uid"]),
        DEFAULT_UMASK if umask is None else umask,
        admin_gid(admin_group),
    )


# ---------------------------------------------------------------------------- what the daemon makes
def open_log(path: Path, owner: Owner | None) -> int:
    """The job's log file opened for appending (its stdout and stderr). For a user's job run by
    a root daemon: created owned by the user, mode from the user's umask, readable by admins;
    an existing one is reused only if it is the user's own regular file (never a symbolic link,
    another user's file or a second name of one)."""
    if owner is None:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    base = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, base | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        fd = -1
    except OSError as err:
        raise _refused(path, err) from None
    if fd >= 0:  # new: nobody else could open it meanwhile (root's, 0600)
        try:
            os.fchown(fd, owner.uid, owner.gid)
            os.fchmod(fd, file_mode(owner.umask))
            grant_admin(fd, owner.admin_gid)
        except BaseException:
            os.close(fd)
            raise
        return fd
    try:  # another run's log: O_NONBLOCK, so that a FIFO put there cannot hang the daemon
        fd = os.open(path, base | os.O_NONBLOCK)
    except OSError as err:
        raise _refused(path, err) from None
    try:
        st = os.fstat(fd)
        why = None
        if not stat.S_ISREG(st.st_mode):
            why = "is not a regular file"
        elif st.st_uid != owner.uid:
            why = f"is owned by uid {st.st_uid}, not by the job's user (uid {owner.uid})"
        elif st.st_nlink != 1:
            why = "has other names (hard links)"
        if why is not None:
            raise TrialError(f"log file {path} {why}; refusing to write the job's output to it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _refused(path: Path, err: OSError) -> TrialError:
    if err.errno == errno.ELOOP:
        return TrialError(f"log file {path} is a symbolic link; refusing to follow it")
    return TrialError(f"cannot open log file {path}: {err.strerror}")


def make_dir(path: Path, owner: Owner) -> None:
    """A directory the root daemon makes for a user's job in a directory of its own (a run's
    info directory, a command's job directory): the user's, mode from the umask, readable by
    admins. An existing one is taken over only when it is the user's or root's own (never
    through a symbolic link)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid not in (0, owner.uid):
            raise TrialError(
                f"directory {path} is owned by uid {st.st_uid}, not by the job's user "
                f"(uid {owner.uid}); remove it"
            )
        os.fchown(fd, owner.uid, owner.gid)
        os.fchmod(fd, dir_mode(owner.umask))
        grant_admin(fd, owner.admin_gid)
    finally:
        os.close(fd)


def give_file(path: Path, owner: Owner, *, secret: bool = False) -> None:
    """A file the root daemon just wrote for the job (in a directory of its own): to the user,
    mode from the umask (readable by admins), or 0600 when it holds a secret of the user's."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchown(fd, owner.uid, owner.gid)
        os.fchmod(fd, 0o600 if secret else file_mode(owner.umask))
        if not secret:
            grant_admin(fd, owner.admin_gid)
    finally:
        os.close(fd)


def makedirs_as_user(path: Path, owner: Owner) -> None:
    """Create `path` and its missing parents with the user's rights (the caller acts as the
    user), each new one with the mode from the user's umask (the daemon's own umask does not
    apply: the mode is set after)."""
    missing: list[Path] = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, dir_mode(owner.umask))
            grant_admin(fd, owner.admin_gid)
        finally:
            os.close(fd)
