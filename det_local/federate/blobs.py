"""An experiment's context snapshot shipped to a peer once, by sha256 digest, and cached there.

The owner packs the snapshot (``paths.context_dir(exp_id)``) into a deterministic tar
(`pack_context`): sorted names, mtime, uid, gid and owner names zeroed, modes 0644 or 0755
(the exec bit kept), so the same tree always has the same digest. `send_context` streams it as
``blob{digest, off, total, data, last}`` messages of at most `MAX_CHUNK` bytes, in order,
reading the file a chunk at a time.

The peer's `ContextCache` treats every byte as hostile until checked. Chunks must arrive in
order into ``root/.incoming/<digest>.part``; the last one is checked against the digest, and
the tar is extracted by hand (never ``extractall``) into a private temporary directory that is
renamed to ``root/<digest>/``: regular files and directories only, relative names without
``..``, no links or devices, names of at most 255 bytes, at most `max_bytes` of content in at
most `max_files` entries. Extracted files belong to the daemon (root in system mode) and are
readable by every user (directories 0755, files 0644 or 0755), since a trial's ranks run as
its submitter. A refusal is one `BlobError` line and leaves no file behind.

A 1 MiB session frame (`transport.SESSION_MAX`) holds the whole frame: sequence number, MAC
and the msgpack envelope (157 bytes for a blob) besides the data, so a chunk carries
`MAX_CHUNK` = 1 MiB - 1 KiB of data.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import stat
import tarfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from det_local.errors import ContextError
from det_local.federate.schema import BLOB_CHUNK_MAX
from det_local.federate.untar import (
    BlobError,
    Extraction,
    write_all,
)
from det_local.store.context import MAX_CONTEXT_BYTES, format_size

MAX_CHUNK = BLOB_CHUNK_MAX - 1024  # the data of one blob message that fits a session frame
MAX_FILES = 100_000
IDLE_S = 120.0  # a transfer silent this long gives its place to a new one
_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Packed:
    """A packed context: its sha256 (hex), the tar file, and the tar's size in bytes."""

    digest: str
    path: Path
    size: int


def tar_cap(max_bytes: int) -> int:
    """The largest tar accepted for `max_bytes` of content: twice it, room for the headers
    (512 bytes and padding per entry) of many small files."""
    return 2 * max_bytes


def valid_digest(value: Any) -> bool:
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


# -- packing (the owner) ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    rel: str
    source: str  # the file to read (a link's target); "" for a directory
    size: int
    mode: int


def pack_context(
    src: Path, out_dir: Path, *, max_bytes: int = MAX_CONTEXT_BYTES, max_files: int = MAX_FILES
) -> Packed:
    """Pack the snapshot `src` into ``out_dir/<digest>.tar`` (written to a temporary file and
    renamed; an existing tar of the same digest is kept). ContextError (one line, naming the
    path) for a tree over `max_bytes` or `max_files`, a link to outside the tree (or to
    nothing), a socket, FIFO or device, or a name that is not UTF-8."""
    root = Path(os.path.abspath(src))
    if not root.is_dir():
        raise ContextError(f"context snapshot {root} is not a directory; nothing to ship")
    entries = _tree(root, max_files)
    total = sum(e.size for e in entries)
    if total > max_bytes:
        raise ContextError(
            f"context snapshot {root} is {format_size(total)}, over the "
            f"{format_size(max_bytes)} limit for shipping to a peer; add large files to "
            ".detignore and resubmit"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{uuid.uuid4().hex}.tar.tmp"
    try:
        with open(tmp, "xb") as raw:
            out = _HashingWriter(raw)
            with tarfile.TarFile(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for entry in entries:
                    _add(tar, root, entry)
            size = out.size
            digest = out.sha.hexdigest()
        if size > tar_cap(max_bytes):
            raise ContextError(
                f"context snapshot {root} packs to {format_size(size)} ({len(entries)} "
                f"entries), over the {format_size(tar_cap(max_bytes))} limit for shipping to a "
                "peer; bundle its many small files into fewer"
            )
        os.chmod(tmp, 0o600)
        final = out_dir / f"{digest}.tar"
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return Packed(digest, final, size)


def _tree(root: Path, max_files: int) -> list[_Entry]:
    """The entries of the tree, each directory before its contents, names sorted."""
    out: list[_Entry] = []
    root_real = os.path.realpath(root)

    def visit(directory: str, rel_dir: str, chain: frozenset[str]) -> None:
        try:
            with os.scandir(directory) as it:
                names = sorted(it, key=lambda e: e.name)
        except OSError as err:
            raise ContextError(
                f"cannot read {directory} in context snapshot {root}: {err.strerror}"
            ) from None
        for entry in names:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            _check_name(root, rel)
            try:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    real = os.path.realpath(entry.path)
                    if not _inside(real, root_real) or not os.path.exists(real):
                        raise ContextError(
                            f"context snapshot {root}: {rel} is a symbolic link to "
                            f"{os.readlink(entry.path)}, outside the tree (or to nothing); "
                            "replace it with the file itself, or remove it"
                        )
                    st = os.stat(real)
                    if stat.S_ISDIR(st.st_mode) and real in chain:
                        raise ContextError(
                            f"context snapshot {root}: {rel} is a symbolic link to its own "
                            "directory or a parent (a loop); remove it"
                        )
                else:
                    real = entry.path
            except OSError as err:
                raise ContextError(
                    f"cannot read {rel} in context snapshot {root}: {err.strerror}"
                ) from None
            if len(out) >= max_files:
                raise ContextError(
                    f"context snapshot {root} has over {max_files} files and directories; "
                    "bundle them into fewer files before shipping it to a peer"
                )
            if stat.S_ISDIR(st.st_mode):
                out.append(_Entry(rel, "", 0, 0o755))
                visit(real, rel, chain | {os.path.realpath(real)})
            elif stat.S_ISREG(st.st_mode):
                mode = 0o755 if st.st_mode & 0o111 else 0o644
                out.append(_Entry(rel, real, st.st_size, mode))
            else:
                raise ContextError(
                    f"context snapshot {root}: {rel} is a {_kind(st.st_mode)}; a context holds "
                    "regular files and directories only, remove it"
                )

    visit(str(root), "", frozenset({root_real}))
    return out


def _check_name(root: Path, rel: str) -> None:
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise ContextError(
            f"context snapshot {root}: the name {rel!r} is not valid UTF-8; rename it"
        ) from None


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _kind(mode: int) -> str:
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device file"
    return "special file"


def _add(tar: tarfile.TarFile, root: Path, entry: _Entry) -> None:
    info = tarfile.TarInfo(entry.rel)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = entry.mode
    if not entry.source:
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        return
    # the snapshot is its user's: what is read is checked on the descriptor that is read (a
    # link or a FIFO swapped in after the walk, or a path leading out of the tree, is refused)
    try:
        fd = os.open(entry.source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise ContextError(
            f"cannot read {entry.rel} in context snapshot {root}: {err.strerror or err}"
        ) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        where = os.path.realpath(f"/proc/self/fd/{fd}")
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_size != entry.size
            or not _inside(where, os.path.realpath(root))
        ):
            raise ContextError(
                f"context snapshot {root}: {entry.rel} changed while it was packed (no longer "
                "the regular file of the tree); submit the experiment again"
            )
        info.size = entry.size
        try:
            tar.addfile(info, f)
        except OSError as err:
            raise ContextError(
                f"cannot read {entry.rel} in context snapshot {root}: {err.strerror or err}"
            ) from None


class _HashingWriter:
    """The file object tarfile writes to: counts and hashes what passes through."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.raw.write(data)
        self.sha.update(data)
        self.size += len(data)
        return len(data)

    def tell(self) -> int:
        return self.size

    def read(self, size: int, /) -> bytes:  # tarfile's writer never reads or seeks
        raise OSError("the packed context is written only")

    def seek(self, pos: int, /) -> int:
        raise OSError("the packed context is written only")

    def close(self) -> None:  # the caller closes the file
        pass


# -- sending (the owner) ---------------------------------------------------------------------


async def send_context(
    send: Callable[[dict[str, Any]], Awaitable[None]], packed: Packed, chunk: int = MAX_CHUNK
) -> None:
    """Send `packed` as blob messages in order, one chunk of the file read at a time."""
    if not 0 < chunk <= MAX_CHUNK:
        raise ValueError(f"chunk of {chunk} bytes: it must be 1..{MAX_CHUNK}")
    with open(packed.path, "rb") as f:
        if os.fstat(f.fileno()).st_size != packed.size:
            raise BlobError(
                f"packed context {packed.path} changed size since it was packed; pack it again",
                "changed",
            )
        off = 0
        while True:
            data = f.read(min(chunk, packed.size - off))
            last = off + len(data) == packed.size
            if not data and not last:
                raise BlobError(
                    f"packed context {packed.path} ended at {off} of {packed.size} bytes; "
                    "pack it again",
                    "changed",
                )
            await send(
                {
                    "t": "blob",
                    "digest": packed.digest,
                    "off": off,
                    "total": packed.size,
                    "data": data,
                    "last": last,
                }
            )
            off += len(data)
            if last:
                return


# -- receiving (the peer) --------------------------------------------------------------------


@dataclass
class _Transfer:
    digest: str
    total: int
    part: Path
    fd: int
    got: int = 0
    sha: Any = field(default_factory=hashlib.sha256)
    touched: float = field(default_factory=time.monotonic)


class ContextCache:
    """Context snapshots received from owners, one directory per digest under `root`."""

    def __init__(
        self,
        root: Path,
        max_bytes: int = MAX_CONTEXT_BYTES,
        max_transfers: int = 4,
        max_files: int = MAX_FILES,
        idle_s: float = IDLE_S,
    ) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.max_transfers = max_transfers
        self.max_files = max_files
        self.idle_s = idle_s
        self.incoming = self.root / ".incoming"
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # the ranks, as their submitters, must reach their context
        shutil.rmtree(self.incoming, ignore_errors=True)  # a previous daemon's transfers
        self.incoming.mkdir(mode=0o700)
        os.chmod(self.incoming, 0o700)
        self._active: dict[str, _Transfer] = {}
        self._lock = threading.Lock()

    def has(self, digest: str) -> Path | None:
        """The extracted context of `digest`, or None when it is not here yet."""
        _need_digest(digest)
        path = self.root / digest
        return path if path.is_dir() else None

    def active(self) -> list[str]:
        """The digests of the transfers under way."""
        with self._lock:
            return sorted(self._active)

    def abandon(self, digest: str) -> bool:
        """Drop a transfer left midway (its link dropped) and its partial file."""
        _need_digest(digest)
        with self._lock:
            transfer = self._active.get(digest)
            if transfer is not None:
                self._drop(transfer)
        return transfer is not None

    def receive(self, digest: str, off: int, total: int, data: bytes, last: bool) -> Path | None:
        """Take one chunk; on the last, verify and extract, and return the context directory.
        BlobError (one line) for anything out of order, oversized, corrupt or unsafe; the
        transfer is then dropped with its files, and the sender must start again at 0."""
        _need_digest(digest)
        tag = digest[:12]
        if not (_is_int(off) and _is_int(total) and isinstance(last, bool)):
            raise BlobError(f"blob {tag}: offset, total or last of the wrong type", "frame")
        if not isinstance(data, bytes) or len(data) > BLOB_CHUNK_MAX:
            raise BlobError(
                f"blob {tag}: a chunk must be at most {BLOB_CHUNK_MAX} bytes of binary data",
                "frame",
            )
        cap = tar_cap(self.max_bytes)
        if not 0 < total <= cap:
            self.abandon(digest)
            raise BlobError(
                f"blob {tag}: a context of {format_size(total)} is over the "
                f"{format_size(cap)} limit for a packed context; the owner must ship a "
                "smaller context",
                "size",
            )
        with self._lock:
            transfer = self._accept(digest, off, total)
            self._check_chunk(transfer, off, total, data, last)
            try:
                write_all(transfer.fd, data)
            except OSError as err:
                self._drop(transfer)
                raise BlobError(
                    f"blob {tag}: cannot write {transfer.part}: {err.strerror}; free space "
                    f"in {self.root}",
                    "disk",
                ) from None
            transfer.sha.update(data)
            transfer.got += len(data)
            transfer.touched = time.monotonic()
            if not last:
                return None
            del self._active[digest]
            os.close(transfer.fd)
        try:
            if transfer.sha.hexdigest() != digest:
                raise BlobError(
                    f"blob {tag}: the {format_size(total)} received hash to "
                    f"{transfer.sha.hexdigest()[:12]}, not {tag} (corrupted in transit, or "
                    "not the context announced); the owner must send it again",
                    "digest",
                )
            return self._extract(digest, transfer.part)
        finally:
            transfer.part.unlink(missing_ok=True)

    # -- internals ---------------------------------------------------------------------------

    def _accept(self, digest: str, off: int, total: int) -> _Transfer:
        transfer = self._active.get(digest)
        if off != 0:
            if transfer is None:
                raise BlobError(
                    f"blob {digest[:12]}: a chunk at offset {off} of a transfer that is not "
                    "under way; send it again from offset 0",
                    "order",
                )
            return transfer
        if transfer is not None:  # a restart: the old attempt's link dropped
            self._drop(transfer)
        now = time.monotonic()
        for stale in [t for t in self._active.values() if now - t.touched > self.idle_s]:
            self._drop(stale)
        if len(self._active) >= self.max_transfers:
            raise BlobError(
                f"blob {digest[:12]}: {len(self._active)} context transfers already under way "
                f"(at most {self.max_transfers}); try again when one finishes",
                "busy",
            )
        part = self.incoming / f"{digest}.part"
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        transfer = _Transfer(digest, total, part, fd)
        self._active[digest] = transfer
        return transfer

    def _check_chunk(self, t: _Transfer, off: int, total: int, data: bytes, last: bool) -> None:
        tag = t.digest[:12]
        problem = None
        if off != t.got:
            problem = f"a chunk at offset {off} where {t.got} was due (out of order)"
        elif total != t.total:
            problem = f"the total changed from {t.total} to {total} bytes"
        elif off + len(data) > total:
            problem = f"a chunk ending at {off + len(data)}, past the total of {total} bytes"
        elif last != (off + len(data) == total):
            problem = f"a chunk ending at {off + len(data)} of {total} bytes " + (
                "marked last" if last else "not marked last"
            )
        elif not data:
            problem = "an empty chunk"
        if problem is not None:
            self._drop(t)
            raise BlobError(
                f"blob {tag}: {problem}; the transfer is dropped, send it again from offset 0",
                "order",
            )

    def _drop(self, transfer: _Transfer) -> None:
        self._active.pop(transfer.digest, None)
        try:
            os.close(transfer.fd)
        except OSError:
            pass
        transfer.part.unlink(missing_ok=True)

    def _extract(self, digest: str, part: Path) -> Path:
        final = self.root / digest
        if final.is_dir():
            return final  # another transfer of the same context finished first
        tmp = self.incoming / f"{digest}.x-{uuid.uuid4().hex[:12]}"
        tmp.mkdir(mode=0o700)
        try:
            try:
                Extraction(digest, tmp, self.max_bytes, self.max_files).run(part)
            except OSError as err:
                raise BlobError(
                    f"blob {digest[:12]}: cannot extract into {self.incoming}: {err.strerror}; "
                    f"free space in {self.root}",
                    "disk",
                ) from None
            os.chmod(tmp, 0o755)
            try:
                os.rename(tmp, final)
            except OSError as err:
                if err.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not final.is_dir():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # the same context, extracted meanwhile
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final


def _need_digest(digest: Any) -> None:
    if not valid_digest(digest):
        raise BlobError(
            f"blob digest {str(digest)[:80]!r} is not 64 lowercase hex characters (a sha256); "
            "the sender is not speaking this protocol",
            "frame",
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
