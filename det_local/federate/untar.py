"""A context tar from a peer, unpacked by hand (never ``extractall``): every member checked
before a byte of it is written (`blobs.ContextCache` calls `Extraction.run` on a finished,
digest-checked transfer). Regular files and directories only, relative names without ``..``,
names of at most `MAX_NAME_BYTES` bytes and paths of `MAX_PATH_BYTES`, the content and entry
caps the cache was given. A refusal is one `BlobError` line."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

from det_local.errors import DetLocalError
from det_local.store.context import format_size

MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4096
_COPY = 1024 * 1024


class BlobError(DetLocalError):
    """A context transfer refused; `code` names the kind for the reply to the sender."""

    def __init__(self, message: str, code: str = "blob") -> None:
        super().__init__(message)
        self.code = code


class Extraction:
    """One tar unpacked by hand into a fresh private directory, each member checked first."""

    def __init__(self, digest: str, dest: Path, max_bytes: int, max_files: int) -> None:
        self.tag = digest[:12]
        self.dest = dest
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.kinds: dict[str, bool] = {}  # name -> is a directory (members and their parents)
        self.seen: set[str] = set()  # the members' names
        self.size = 0

    def refuse(self, what: str, code: str = "member") -> BlobError:
        return BlobError(
            f"blob {self.tag}: {what}; the context is refused (check det-local on the sending "
            "node: it packs regular files and directories only)",
            code,
        )

    def run(self, part: Path) -> None:
        try:
            with tarfile.open(part, mode="r:", encoding="utf-8", errors="strict") as tar:
                while (member := tar.next()) is not None:
                    self.add(tar, member)
        except (tarfile.TarError, UnicodeError, EOFError) as err:
            raise self.refuse(f"not a valid tar ({err})", "tar") from None

    def add(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        name = self.checked_name(member)
        if len(self.kinds) >= self.max_files:
            raise self.refuse(f"over {self.max_files} files and directories", "size")
        if member.isdir():
            self.make_dirs(name)
            return
        if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or member.sparse is not None:
            raise self.refuse(f"member {name!r} is a {_member_kind(member)}")
        self.size += member.size
        if self.size > self.max_bytes:
            raise self.refuse(
                f"its files total over {format_size(self.max_bytes)} (at member {name!r})", "size"
            )
        if name in self.kinds:
            raise self.refuse(f"member {name[:100]!r} is a file where a directory is")
        parent, _, _ = name.rpartition("/")
        if parent:
            self.make_dirs(parent)
        self.kinds[name] = False
        source = tar.extractfile(member)
        if source is None:
            raise self.refuse(f"member {name!r} has no data")
        mode = 0o755 if member.mode & 0o111 else 0o644
        fd = os.open(self.dest / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            left = member.size
            while left > 0:
                try:
                    data = source.read(min(_COPY, left))
                except (tarfile.TarError, OSError) as err:
                    raise self.refuse(f"member {name!r} is cut short ({err})", "tar") from None
                if not data:
                    raise self.refuse(f"member {name!r} is cut short", "tar")
                write_all(fd, data)
                left -= len(data)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def checked_name(self, member: tarfile.TarInfo) -> str:
        name = member.name
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise self.refuse(f"member {name[:100]!r} has a name that is not UTF-8") from None
        if name.startswith("/"):
            raise self.refuse(f"member {name[:100]!r} has an absolute path")
        parts = name.split("/")
        if ".." in parts:
            raise self.refuse(f"member {name[:100]!r} climbs out with '..'")
        if "\0" in name or any(p in ("", ".") for p in parts):
            raise self.refuse(f"member {name[:100]!r} has an empty, '.' or NUL path component")
        if len(name.encode()) > MAX_PATH_BYTES or any(
            len(p.encode()) > MAX_NAME_BYTES for p in parts
        ):
            raise self.refuse(
                f"member {name[:100]!r} has a name over {MAX_NAME_BYTES} bytes or a path over "
                f"{MAX_PATH_BYTES}"
            )
        if name in self.seen:
            raise self.refuse(f"member {name[:100]!r} appears twice")
        self.seen.add(name)
        return name

    def make_dirs(self, name: str) -> None:
        parts = name.split("/")
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            kind = self.kinds.get(sub)
            if kind is None:
                os.mkdir(self.dest / sub, 0o700)
                os.chmod(self.dest / sub, 0o755)
                self.kinds[sub] = True
            elif not kind:
                raise self.refuse(f"member {name[:100]!r} lies under the file {sub!r}")


def _member_kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return "symbolic link"
    if member.islnk():
        return "hard link"
    if member.ischr() or member.isblk():
        return "device file"
    if member.isfifo():
        return "FIFO"
    if member.sparse is not None:
        return "sparse file"
    return f"tar entry of type {member.type!r}"


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
