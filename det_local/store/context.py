"""The context directory: which files a submission includes, and the snapshot taken of them.

An experiment runs from a copy of its context directory taken at submission, so later edits to
the user's directory never reach a queued or running trial. The rules follow Determined's
``det experiment create`` upload:

* ``.detignore`` in the context root (only the root one, as Determined reads it) uses the full
  gitignore syntax: comments, ``!`` negation, ``**``, anchored ``/x``, directory-only ``x/`` and
  escaped characters. As in git, a file inside an ignored directory cannot be re-included by a
  later ``!`` pattern: ignored directories are not entered at all. Files named ``.detignore``
  are never included (Determined drops them at every level).
* Determined's default ignores come first, so ``.detignore`` can re-include them with ``!``:
  ``.git/``, ``.vscode/``, ``.idea/``, ``.mypy_cache/``, ``/shared_fs`` and the terraform files
  ``det deploy`` leaves behind (see ``DEFAULT_IGNORES``).
* Byte-compiled Python (``__pycache__/``, ``*.pyc``, ``*.pyo``, ``*$py.class``) is always skipped,
  whatever ``.detignore`` says: a stale compilation must never run in place of the source.
* Symbolic links: a link to a regular file is included with its target's content, wherever the
  target lives (Determined's upload reads through links too); a broken link is skipped. A link to a
  directory is followed only when its target lies inside the context and is not the link's own
  directory or one of its ancestors (so no loops); links to directories outside the context are
  skipped, so a ``data -> /datasets/imagenet`` link does not pull a data set into the snapshot.
  Sockets, FIFOs and device files are skipped.
* Directories that are not ignored are recreated in the snapshot even when empty.
* The included files may total at most ``MAX_CONTEXT_BYTES`` (95 MiB, Determined's limit); the
  check runs before anything is copied, and its error lists the largest files.
* A top-level ``determined`` package or module (``determined/__init__.py``, ``determined.py`` or
  a ``determined*.so`` extension) is refused: the entrypoint's directory comes first on
  ``sys.path`` and would shadow the ``determined`` API det-local provides. Excluding it with
  ``.detignore`` is enough.
* A file or directory that cannot be read is an error naming it, not a silent omission.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pathspec

from det_local.errors import ContextError

MAX_CONTEXT_BYTES = 95 * 1024 * 1024

DETIGNORE = ".detignore"

# Determined's DEFAULT_DETIGNORE minus the byte-code patterns, which ALWAYS_IGNORED enforces.
DEFAULT_IGNORES: tuple[str, ...] = (
    "terraform",
    "terraform_data",
    "terraform.tfstate*",
    "terraform.tfvars*",
    ".terraform*",
    ".git/",
    ".vscode/",
    ".idea/",
    ".mypy_cache/",
    "/shared_fs",
)

# Applied after .detignore, so no negation can bring these back.
ALWAYS_IGNORED: tuple[str, ...] = ("__pycache__/", "*.py[co]", "*$py.class")

_SHADOW_FILE = re.compile(r"determined(\.py|\.so|\.[^/]*\.so)")
_LARGEST_SHOWN = 5
_UNREADABLE_SHOWN = 5


@dataclass(frozen=True)
class ContextFile:
    """One file of a context, by its POSIX path relative to the context root, and its size."""

    rel_path: str
    size: int


def list_context(src: Path) -> list[ContextFile]:
    """The files a submission of ``src`` includes, sorted by path.

    Raises ContextError when ``src`` is missing or not a directory, when a file cannot be read,
    when the context holds a top-level ``determined`` package, or when it exceeds 95 MiB."""
    root = _check_root(src)
    spec, always = _load_specs(root)
    files, unreadable = _walk(root, spec, always)
    _check_shadowing(root, files)
    if unreadable:
        _raise_unreadable(root, unreadable)
    _check_size(root, files)
    return [ContextFile(rel, size) for rel, size, _ in sorted(files)]


def snapshot_context(src: Path, dest: Path) -> list[ContextFile]:
    """Copy the files ``list_context(src)`` includes into the new directory ``dest``.

    Every check runs before anything is written. Files keep their mode bits (an executable stays
    executable) and modification times. The copy is built in a hidden sibling of ``dest`` and
    renamed into place, so ``dest`` either does not exist or holds the whole snapshot."""
    root = _check_root(src)
    dest = Path(os.path.abspath(dest))
    if os.path.lexists(dest):
        raise ContextError(
            f"snapshot destination {dest} already exists; snapshots are never overwritten, "
            "remove it or choose a new directory"
        )
    spec, always = _load_specs(root)
    dirs_out: list[str] = []
    files, unreadable = _walk(root, spec, always, dirs_out)
    _check_shadowing(root, files)
    if unreadable:
        _raise_unreadable(root, unreadable)
    _check_size(root, files)

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:12]}"
    copied: list[ContextFile] = []
    try:
        tmp.mkdir()
        for rel_dir in dirs_out:
            (tmp / rel_dir).mkdir(parents=True, exist_ok=True)
        for rel, _, source in sorted(files):
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                shutil.copy2(source, target)
            except OSError as err:
                raise ContextError(
                    f"cannot copy {rel} from context {root}: {_reason(err)}; "
                    "fix its permissions or add it to .detignore"
                ) from err
            copied.append(ContextFile(rel, target.stat().st_size))
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return copied


# -- internals ---------------------------------------------------------------------------------


def _check_root(src: Path) -> Path:
    path = Path(os.path.abspath(src))
    if not os.path.lexists(path):
        raise ContextError(
            f"context directory {path} does not exist; pass the directory holding your "
            "training code (e.g. `det-local run config.yaml .`)"
        )
    if not path.is_dir():
        raise ContextError(
            f"context {path} is not a directory; pass the directory holding your training "
            "code, not a file inside it"
        )
    return path


def _load_specs(root: Path) -> tuple[pathspec.PathSpec, pathspec.PathSpec]:
    lines: list[str] = list(DEFAULT_IGNORES)
    ignore_file = root / DETIGNORE
    if ignore_file.is_file():
        try:
            text = ignore_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ContextError(
                f"cannot read {ignore_file}: {_reason(err)}; make it a readable UTF-8 text file"
            ) from err
        lines.extend(text.splitlines())
    try:
        spec = pathspec.GitIgnoreSpec.from_lines(lines)
    except Exception:  # pathspec raises its own pattern error types; find the line
        for number, line in enumerate(lines[len(DEFAULT_IGNORES) :], start=1):
            try:
                pathspec.GitIgnoreSpec.from_lines([line])
            except Exception as err:
                raise ContextError(
                    f"{ignore_file}:{number}: invalid pattern {line!r} ({err}); "
                    "fix it using .gitignore syntax"
                ) from err
        raise
    return spec, pathspec.GitIgnoreSpec.from_lines(ALWAYS_IGNORED)


def _ignored(rel: str, is_dir: bool, spec: pathspec.PathSpec, always: pathspec.PathSpec) -> bool:
    key = rel + "/" if is_dir else rel
    return always.match_file(key) or spec.match_file(key)


def _walk(
    root: Path,
    spec: pathspec.PathSpec,
    always: pathspec.PathSpec,
    dirs_out: list[str] | None = None,
) -> tuple[list[tuple[str, int, str]], list[tuple[str, str]]]:
    """(rel_path, size, source path) of every included file, and (rel_path, reason) of every
    included file or directory that cannot be read."""
    files: list[tuple[str, int, str]] = []
    unreadable: list[tuple[str, str]] = []
    root_real = os.path.realpath(root)

    def visit(directory: str, rel_dir: str, chain: frozenset[str]) -> None:
        try:
            with os.scandir(directory) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as err:
            unreadable.append((rel_dir + "/" if rel_dir else ".", _reason(err)))
            return
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if entry.name == DETIGNORE:
                continue  # Determined never uploads them; only the root one is read
            try:
                is_link = entry.is_symlink()
                st = os.stat(entry.path) if is_link else entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # broken symlink, or removed while we looked
            except OSError as err:
                if _ignored(rel, False, spec, always):
                    continue
                unreadable.append((rel, _reason(err)))
                continue
            if stat.S_ISDIR(st.st_mode):
                if _ignored(rel, True, spec, always):
                    continue
                real = os.path.realpath(entry.path)
                if is_link and (not _inside(real, root_real) or real in chain):
                    continue  # outside the context, or a loop back to an ancestor
                if dirs_out is not None:
                    dirs_out.append(rel)
                visit(entry.path, rel, chain | {real})
            elif stat.S_ISREG(st.st_mode):
                if _ignored(rel, False, spec, always):
                    continue
                problem = _unreadable_reason(entry.path)
                if problem is not None:
                    unreadable.append((rel, problem))
                    continue
                files.append((rel, st.st_size, entry.path))
            # sockets, FIFOs, devices: never part of a context

    visit(str(root), "", frozenset({root_real}))
    return files, unreadable


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _unreadable_reason(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        return _reason(err)
    os.close(fd)
    return None


def _reason(err: BaseException) -> str:
    if isinstance(err, OSError) and err.errno is not None:
        return err.strerror or errno.errorcode.get(err.errno, str(err))
    return str(err)


def _check_shadowing(root: Path, files: Iterable[tuple[str, int, str]]) -> None:
    for rel, _, _ in files:
        if rel == "determined/__init__.py" or _SHADOW_FILE.fullmatch(rel):
            what = "package determined/" if rel.startswith("determined/") else f"module {rel}"
            raise ContextError(
                f"context {root} has a top-level {what}, which would shadow the `determined` "
                f"API that det-local provides to your code; rename it, or add "
                f"`/{rel.split('/')[0]}` to {root / DETIGNORE} if the trial does not need it"
            )


def _raise_unreadable(root: Path, unreadable: list[tuple[str, str]]) -> None:
    shown = ", ".join(f"{rel} ({why})" for rel, why in unreadable[:_UNREADABLE_SHOWN])
    more = len(unreadable) - _UNREADABLE_SHOWN
    tail = f" and {more} more" if more > 0 else ""
    raise ContextError(
        f"cannot read {len(unreadable)} path(s) in context {root}: {shown}{tail}; "
        f"fix their permissions or add them to {root / DETIGNORE}"
    )


def _check_size(root: Path, files: list[tuple[str, int, str]]) -> None:
    total = sum(size for _, size, _ in files)
    if total <= MAX_CONTEXT_BYTES:
        return
    largest = sorted(files, key=lambda f: (-f[1], f[0]))[:_LARGEST_SHOWN]
    shown = ", ".join(f"{rel} ({format_size(size)})" for rel, size, _ in largest)
    raise ContextError(
        f"context {root} is {format_size(total)} in {len(files)} files, over the "
        f"{format_size(MAX_CONTEXT_BYTES)} limit; largest files: {shown}; add them to "
        f"{root / DETIGNORE} or move data outside the context and read it from there"
    )


def format_size(size: int) -> str:
    """Bytes as a short human figure in binary units: ``523 B``, ``12.0 KiB``, ``95.0 MiB``."""
    if size < 1024:
        return f"{size} B"
    value = float(size)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")
