"""TensorBoard files of a staged run (`slurm.stage_dir`) brought back to where a local run's are.

A staged trial's ``DET_LOCAL_TENSORBOARD_DIR`` (``get_tensorboard_path()``, a PyTorchTrial's
SummaryWriter) is ``<staged>/info/tensorboard``, on the shared filesystem, removed when the run
ends. Its files are copied into the run's own ``<info dir>/tensorboard`` in the state directory
(where a local run writes them, under the trial's directory, which `det-local tensorboard
start` reads), by the log pump's thread (`stage.LogPump`), never on the event
loop: while the job runs, at most ``PASS_BYTES`` a run and pass; when it has ended, the rest up
to ``FINAL_BYTES``.

Event files are only appended to, so a file's copy is its staged bytes from the local copy's
size on; a staged file replaced by another (a new inode, seen by the same daemon) or shorter
than its copy is copied again from its start. What the run's user wrote is hostile
input under a root daemon: both trees are walked by directory descriptors opened without
following links (a symbolic link, FIFO or device is skipped, as is anything not the user's own);
at most ``MAX_FILES`` files (of ``MAX_ENTRIES`` names read), at most ``MAX_DEPTH`` directories
below ``tensorboard/``, are looked at a pass (a run's files beyond those are left out: a
TensorBoard directory holds a few event files and traces); the copies are the user's (made by
the daemon, owned by the user, mode from the user's umask), and an existing local file or
directory is written only when it is the user's own regular file (one name) or directory.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from det_local.sched.run import userfiles
from det_local.store.acl import grant_admin

DIR = "tensorboard"
PASS_BYTES = 4 * 1024 * 1024  # copied per run and pass while the job runs
FINAL_BYTES = 256 * 1024 * 1024  # copied at most once the job has ended
MAX_FILES = 1000
MAX_ENTRIES = 4000  # names read a run and pass (files, directories, anything else)
MAX_DEPTH = 8
READ = 1024 * 1024
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class Budget:
    bytes: int
    inodes: dict[str, int]  # relative name -> the staged file's inode when last copied
    files: int = MAX_FILES
    entries: int = MAX_ENTRIES
    copied: int = 0


def copy(
    staged_root_fd: int,
    local_info_fd: int,
    owner: userfiles.Owner | None,
    limit: int,
    inodes: dict[str, int] | None = None,
) -> int:
    """Copy what the staged ``info/tensorboard`` gained into ``<local info>/tensorboard``
    (``staged_root_fd``: the staged run's directory; ``local_info_fd``: the run's own info
    directory); returns the bytes copied (at most ``limit``). ``inodes`` (kept by the caller
    from pass to pass): a staged file replaced by another (a new inode), or shorter than its
    copy, is copied again from its start."""
    if inodes is None:
        inodes = {}
    if len(inodes) > 4 * MAX_FILES:  # names that come and go: forget (appends still copied)
        inodes.clear()
    uid = os.geteuid() if owner is None else owner.uid
    src = _open_dir(staged_root_fd, "info", uid)
    if src is None:
        return 0
    try:
        top = _open_dir(src, DIR, uid)
        if top is None:
            return 0
        try:
            dst = _local_dir(local_info_fd, DIR, owner)
            if dst is None:
                return 0
            try:
                budget = Budget(limit, inodes)
                _copy_dir(top, dst, owner, uid, budget, 0, "")
                return budget.copied
            finally:
                os.close(dst)
        finally:
            os.close(top)
    finally:
        os.close(src)


def _open_dir(parent: int, name: str, uid: int) -> int | None:
    """A staged directory of the run's user, never through a link."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError:
        return None
    if os.fstat(fd).st_uid != uid:
        os.close(fd)
        return None
    return fd


def _local_dir(parent: int, name: str, owner: userfiles.Owner | None) -> int | None:
    """``name`` in the run's own info directory: made as the user's when missing; an existing
    one only when it is the user's (or the daemon's, for a run of the daemon's user)."""
    try:
        os.mkdir(name, 0o755 if owner is None else 0o700, dir_fd=parent)
        made = True
    except FileExistsError:
        made = False
    except OSError:
        return None
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError:
        return None
    try:
        uid = os.fstat(fd).st_uid
        if owner is None:
            if uid == os.geteuid():
                return fd  # the daemon's user's run: the daemon's umask applies
        elif uid == owner.uid or (made and uid == os.geteuid()):
            if made:
                os.fchown(fd, owner.uid, owner.gid)
                os.fchmod(fd, userfiles.dir_mode(owner.umask))
                grant_admin(fd, owner.admin_gid)
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _copy_dir(
    src: int,
    dst: int,
    owner: userfiles.Owner | None,
    uid: int,
    budget: Budget,
    depth: int,
    prefix: str,
) -> None:
    names: list[str] = []
    try:
        with os.scandir(src) as entries:  # a directory of a million names: MAX_ENTRIES read
            for entry in entries:
                if budget.entries <= 0:
                    break
                budget.entries -= 1
                names.append(entry.name)
    except OSError:
        return
    for name in sorted(names):
        if budget.copied >= budget.bytes or budget.files <= 0:
            return
        try:
            st = os.stat(name, dir_fd=src, follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != uid:
            continue
        if stat.S_ISDIR(st.st_mode) and depth < MAX_DEPTH:
            sub = _open_dir(src, name, uid)
            if sub is None:
                continue
            try:
                out = _local_dir(dst, name, owner)
                if out is not None:
                    try:
                        _copy_dir(sub, out, owner, uid, budget, depth + 1, f"{prefix}{name}/")
                    finally:
                        os.close(out)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            budget.files -= 1
            _copy_file(src, dst, name, owner, uid, budget, prefix + name)


def _copy_file(
    src: int,
    dst: int,
    name: str,
    owner: userfiles.Owner | None,
    uid: int,
    budget: Budget,
    rel: str,
) -> None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=src)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            return
        out = _local_file(dst, name, owner)
        if out is None:
            return
        try:
            offset = os.fstat(out).st_size
            if budget.inodes.get(rel, st.st_ino) != st.st_ino or st.st_size < offset:
                os.ftruncate(out, 0)  # rewritten (replaced, or shorter): copied anew
                offset = 0
            budget.inodes[rel] = st.st_ino
            while offset < st.st_size and budget.copied < budget.bytes:
                data = os.pread(fd, min(READ, budget.bytes - budget.copied), offset)
                if not data:
                    break
                os.pwrite(out, data, offset)
                offset += len(data)
                budget.copied += len(data)
        finally:
            os.close(out)
    except OSError:
        return
    finally:
        os.close(fd)


def _local_file(dst: int, name: str, owner: userfiles.Owner | None) -> int | None:
    """The local copy of ``name``, opened for writing: new (the user's), or the user's own
    regular file with one name; never through a link, never a FIFO."""
    flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(
            name, flags | os.O_CREAT | os.O_EXCL, 0o644 if owner is None else 0o600, dir_fd=dst
        )
    except FileExistsError:
        fd = -1
    except OSError:
        return None
    try:
        if fd >= 0:
            if owner is not None:  # root's until given: nobody else could open it meanwhile
                os.fchown(fd, owner.uid, owner.gid)
                os.fchmod(fd, userfiles.file_mode(owner.umask))
                grant_admin(fd, owner.admin_gid)
            return fd
        fd = os.open(name, flags, dir_fd=dst)
        st = os.fstat(fd)
        want = os.geteuid() if owner is None else owner.uid
        if stat.S_ISREG(st.st_mode) and st.st_uid == want and st.st_nlink == 1:
            return fd
    except OSError:
        pass
    if fd >= 0:
        os.close(fd)
    return None
