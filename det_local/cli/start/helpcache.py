"""Help answered without importing typer: `det-local -h`, `det-local job -h`, `cmd run -h`.

Help depends only on the code (the command modules, typer, the interpreter), the terminal's
width and the words asked about, so the first time an argv is asked its answer (stdout, stderr,
exit status) is made by the real typer app, captured, and kept in the user's cache directory;
later the same argv prints the kept answer in a few milliseconds. Typer's own work is ~80% of a
help's time (its import alone is ~55 ms of CPU on a 2-core machine).

Never stale: each answer keeps the (path, size, mtime, inode) of every module file that was
loaded when it was made (det_local's, typer's, the standard library's) and is used only while
all of them are unchanged; an upgrade, an editable change or another typer makes it again.
The cache file is one per interpreter and det_local location, written atomically, owner-only,
and read or written only when it and its directory are the user's own and nobody else may write
them (`sudo` keeping another user's HOME writes nothing there); anything unexpected in
it (or no cache directory) means the answer is made by typer, as without a cache.

Only pure help is kept: no arguments at all, or up to two command words (lower-case names)
followed by `-h`/`--help`, answered with status 0 or 2 (help, or an unknown command's one line).
"""

from __future__ import annotations

import os
import sys
from stat import S_ISDIR
from typing import Any

HELP_FLAGS = ("-h", "--help")
VERSION = 1  # of the file's layout
MAX_ENTRIES = 200
MAX_FILE_BYTES = 4 << 20


def eligible(argv: list[str]) -> bool:
    if os.environ.get("_DET_LOCAL_COMPLETE"):
        return False
    if not argv:
        return True
    words = argv[:-1]
    return argv[-1] in HELP_FLAGS and len(words) <= 2 and all(_word(w) for w in words)


def _word(w: str) -> bool:
    return 0 < len(w) <= 40 and w[0].isalpha() and all(c.islower() or c == "-" for c in w)


def _key(argv: list[str]) -> str:
    try:
        size: Any = tuple(os.get_terminal_size(1))
    except OSError:
        size = None
    env = (os.environ.get("COLUMNS"), os.environ.get("TYPER_USE_RICH"))
    return repr((tuple(argv), size, env))


def cache_file() -> str | None:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(base):
        return None
    import zlib

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tag = zlib.crc32(f"{sys.executable}\0{sys.version}\0{here}".encode())
    return os.path.join(base, "det-local", f"help-{tag:08x}.marshal")


def _own_directory(path: str, strict: bool = True) -> bool:
    """A directory of this user's own (not a symbolic link); strict: nobody else may write it."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return False
    return not (strict and st.st_mode & 0o022)


def _load(path: str) -> dict[str, Any]:
    import marshal

    if not _own_directory(os.path.dirname(path)):
        return {}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022 or st.st_size > MAX_FILE_BYTES:
            return {}
        with os.fdopen(os.dup(fd), "rb") as f:
            data = marshal.loads(f.read())
    except (OSError, ValueError, EOFError, TypeError):
        return {}
    finally:
        os.close(fd)
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _fresh(deps: Any) -> bool:
    if not isinstance(deps, tuple) or not deps:
        return False
    for dep in deps:
        path, size, mtime, ino = dep
        try:
            st = os.stat(path)
        except OSError:
            return False
        if (st.st_size, st.st_mtime_ns, st.st_ino) != (size, mtime, ino):
            return False
    return True


def lookup(argv: list[str]) -> tuple[str, str, int] | None:
    """The kept answer to argv, if there is one and nothing it was made from changed."""
    path = cache_file()
    if path is None:
        return None
    entry = _load(path).get(_key(argv))
    try:
        deps, out, err, rc = entry  # type: ignore[misc]
    except (TypeError, ValueError):
        return None
    if not (isinstance(out, str) and isinstance(err, str) and isinstance(rc, int)):
        return None
    try:
        fresh = _fresh(deps)
    except (TypeError, ValueError):
        return None
    return (out, err, rc) if fresh else None


def _deps() -> tuple[tuple[str, int, int, int], ...]:
    found = []
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        if not isinstance(name, str):
            continue
        try:
            st = os.stat(name)
        except OSError:
            continue
        found.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sorted(set(found)))


def keep(argv: list[str], out: str, err: str, rc: int) -> None:
    """Keep an answer made by typer (best effort: no cache directory means no cache)."""
    import marshal

    path = cache_file()
    if path is None:
        return
    try:
        directory = os.path.dirname(path)
        base = os.path.dirname(directory)
        home_ok = _own_directory(os.path.dirname(base), strict=False)
        base_ok = _own_directory(base, strict=False) or (home_ok and not os.path.lexists(base))
        if not base_ok:
            return  # another user's (`sudo` keeping HOME), or a link: write nothing there
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if not _own_directory(directory):
            return
        entries = _load(path)
        if len(entries) >= MAX_ENTRIES:
            entries = {}
        entries[_key(argv)] = (_deps(), out, err, rc)
        data = marshal.dumps({"version": VERSION, "entries": entries})
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except (OSError, ValueError):
        try:
            os.unlink(f"{path}.{os.getpid()}.tmp")
        except OSError:
            pass


def emit(out: str, err: str) -> None:
    """Print an answer as the CLI would (a closed reader ends the output silently)."""
    for stream, text in ((sys.stdout, out), (sys.stderr, err)):
        if not text:
            continue
        try:
            stream.write(text)
            stream.flush()
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())  # no second error when Python flushes at exit
            os.close(devnull)


def answer(argv: list[str]) -> int | None:
    """Help for argv from the cache (its exit status), or None: the caller runs the CLI."""
    if not eligible(argv):
        return None
    hit = lookup(argv)
    if hit is None:
        return None
    out, err, rc = hit
    emit(out, err)
    return rc


def make(argv: list[str], run: Any) -> int:
    """Run the CLI (`run()`: its exit status) with its output captured; keep and print it."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = run()
    if rc in (0, 2):
        keep(argv, out.getvalue(), err.getvalue(), rc)
    emit(out.getvalue(), err.getvalue())
    return int(rc)
