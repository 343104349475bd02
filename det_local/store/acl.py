"""The admin group's read access to a user's private files: one POSIX ACL entry.

A user who keeps their files private (umask 077) still lets det-local's admin group
(settings.admin_group) read their job's logs and checkpoints: ``group:<admin>:r`` (``r-x`` on a
directory) is added to the access ACL of whatever the mode hides from others. It is written
directly as the ``system.posix_acl_access`` attribute (no setfacl, no dependency); on a
filesystem without ACLs the admin group becomes the file's group instead (group bits r/r-x).
Used by the root daemon (the files it makes for a job) and by a trial (its checkpoint files).
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path

_ACL_VERSION = 2
_USER_OBJ, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x04, 0x08, 0x10, 0x20
_UNDEFINED = 0xFFFFFFFF


def _acl(mode: int, gid: int, perm: int) -> bytes:
    """The system.posix_acl_access value: the mode's entries plus group `gid` with `perm`."""
    group_obj = (mode >> 3) & 7
    entries = [
        (_USER_OBJ, (mode >> 6) & 7, _UNDEFINED),
        (_GROUP_OBJ, group_obj, _UNDEFINED),
        (_GROUP, perm, gid),
        (_MASK, group_obj | perm, _UNDEFINED),
        (_OTHER, mode & 7, _UNDEFINED),
    ]
    return struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", *e) for e in entries)


def grant_admin(fd: int, admin: int | None) -> None:
    """Let the admin group read what fd's mode hides from others (a directory: and enter it).
    fd's owner (or root) calls it."""
    if admin is None:
        return
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    is_dir = stat.S_ISDIR(st.st_mode)
    perm = 5 if is_dir else 4
    if mode & 0o004 and (not is_dir or mode & 0o001):
        return  # others may read it already
    try:
        os.setxattr(fd, "system.posix_acl_access", _acl(mode, admin, perm))
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
            raise
        # no ACLs on this filesystem: the admin group owns the file instead
        os.fchown(fd, -1, admin)
        os.fchmod(fd, (mode & ~0o070) | (perm << 3))


def grant_admin_tree(root: Path, admin: int) -> None:
    """grant_admin() on root and everything under it (a checkpoint its owner just wrote);
    links are skipped, never followed."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for path in [dirpath, *(os.path.join(dirpath, f) for f in filenames)]:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:  # a link, or gone meanwhile
                continue
            try:
                grant_admin(fd, admin)
            except OSError:
                pass  # not this user's to change (only its owner may): left as it is
            finally:
                os.close(fd)
