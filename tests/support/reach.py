"""What the ordinary test accounts must reach, opened while tests need it and put back after.

The suite submits work as ordinary Unix accounts (`tests.support.users`: A, B, ADMIN): a root
daemon runs their trials, ranks and Slurm steps with this interpreter, from this checkout. Such
an account must be able to enter (o+x) every directory above the interpreter and each link on
the way to it (a venv's `bin/python` links to the base interpreter elsewhere), above the venv's
`sys.prefix` and site-packages (det_local's dependencies, torch), and above the checkout
(det_local itself when installed editable, the test scripts and contexts). A clone in a private
home (0700), or a pyenv Python under /root, is out of their reach.

    with python_reachable(on_blocked=pytest.skip):
        ...  # work submitted as A runs `sys.executable -m det_local...`

gives o+x to each of those directories that lacks it, checks as the account that it can now
start the interpreter and import det-local, and puts each mode back when the last holder that
needed it is done. Where a directory cannot be opened (a filesystem that refuses chmod, a
mount root squashes), `on_blocked` gets one line naming the directory, the account and what to
do (by default `Unreachable` is raised with it).

Holders are counted across processes (several pytest runs, several checkouts at once) in
STATE, under its flock: `count` (every holder), `modes` (each opened directory's own mode),
`users` (which holders need each directory) and `holders` (pid and start time: a holder
killed with -9 is found dead by the next entry, or by `restore_leftovers` at a session's start,
and what only it needed is put back). `count` and `modes` keep the meaning older checkouts'
helper gave them (it counted holders there and restored every mode at zero), so the two agree
on one machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import det_local
from tests.support.paths import REPO
from tests.support.users import A

STATE = Path("/tmp/det-local-interpreter-reachable.lock")
# the interpreter's own directories: printed by the interpreter itself (another venv's too)
_WHERE = (
    "import json, site, sys, sysconfig\n"
    "p = sysconfig.get_paths()\n"
    "print(json.dumps([sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix,\n"
    "    sys.base_exec_prefix, *(p[k] for k in ('stdlib', 'platstdlib', 'purelib', 'platlib')),\n"
    "    *site.getsitepackages()]))\n"
)
_probed: set[tuple[str, ...]] = set()  # (account, python, imports) this process saw work
_needed: dict[tuple[str, ...], list[Path]] = {}  # (python, *paths) -> what needed() found


class Unreachable(RuntimeError):
    """An account cannot reach what it must run (the message is one line)."""


def _raise(line: str) -> NoReturn:
    raise Unreachable(line)


def links(path: Path) -> list[Path]:
    """`path` and every link on the way to its target (each hop of a symlink chain)."""
    chain = [path]
    for _ in range(40):
        if not chain[-1].is_symlink():
            break
        chain.append(chain[-1].parent / os.readlink(chain[-1]))
    return chain


def needed(python: str, paths: Sequence[Path]) -> list[Path]:
    """The directories an account enters to run `python` and reach `paths`, root first."""
    key = (python, *map(str, paths))
    if key not in _needed:
        _needed[key] = _needed_now(python, paths)
    return _needed[key]


def _needed_now(python: str, paths: Sequence[Path]) -> list[Path]:
    out = subprocess.run(
        [python, "-c", _WHERE], capture_output=True, text=True, check=True, timeout=60
    )
    targets = [*links(Path(python)), *map(Path, json.loads(out.stdout)), *paths]
    seen: dict[Path, None] = {}
    for target in filter(os.path.lexists, targets):  # Debian's schemes name some that are not
        for p in {target, *links(target), Path(os.path.realpath(target))}:
            p = Path(os.path.abspath(p))
            for d in [*reversed(p.parents), *([p] if p.is_dir() else [])]:
                seen.setdefault(d)
    return list(seen)


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: start time, in clock ticks


def _me() -> str:
    return f"{os.getpid()}:{_start_time(os.getpid())}"


def _alive(holder: str) -> bool:
    pid, _, start = holder.partition(":")
    return pid.isdigit() and _start_time(int(pid)) == start


@contextlib.contextmanager
def _state() -> Iterator[dict[str, Any]]:
    """The shared state, read and written back under its flock."""
    fd = os.open(STATE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        raw = b""
        while chunk := os.read(fd, 65536):
            raw += chunk
        state: dict[str, Any] = json.loads(raw) if raw.strip() else {}
        state.setdefault("count", 0)
        state.setdefault("modes", {})
        state.setdefault("users", {})
        state.setdefault("holders", {})
        yield state
        os.lseek(fd, 0, 0)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(state).encode())
    finally:
        os.close(fd)  # releases the lock


def _settle(state: dict[str, Any]) -> None:
    """Forget dead holders; put back each mode no live holder needs."""
    for holder, n in list(state["holders"].items()):
        if not _alive(holder):
            del state["holders"][holder]
            state["count"] -= n
    for name in list(state["users"]):
        state["users"][name] = [h for h in state["users"][name] if h in state["holders"]]
    state["count"] = max(0, state["count"])
    anonymous = state["count"] - sum(state["holders"].values())  # older checkouts' holders
    for name in list(state["modes"]):
        if state["count"] == 0 or (anonymous <= 0 and not state["users"].get(name)):
            with contextlib.suppress(OSError):
                Path(name).chmod(state["modes"][name])
            del state["modes"][name]
            state["users"].pop(name, None)
    if state["count"] == 0:
        state["holders"] = {}
    # (an older checkouts' helper empties `modes` when it is the first holder)
    state["users"] = {k: v for k, v in state["users"].items() if k in state["modes"]}


def restore_leftovers() -> None:
    """Put back what holders that died (killed with -9) had opened."""
    with _state() as state:
        _settle(state)


def _open(dirs: Sequence[Path], state: dict[str, Any], me: str) -> dict[Path, str]:
    """o+x on each of `dirs` lacking it (its mode kept in the state); what refused and why."""
    refused: dict[Path, str] = {}
    for d in dirs:
        name = str(d)
        try:
            mode = d.stat().st_mode & 0o7777
            if not mode & 0o001:
                d.chmod(mode | 0o001)
                state["modes"].setdefault(name, mode)
        except OSError as err:
            refused[d] = err.strerror or str(err)
            continue
        if name in state["modes"] and me not in state["users"].setdefault(name, []):
            state["users"][name].append(me)
    return refused


def _as(account: str) -> dict[str, Any]:
    return {"user": account, "group": pwd.getpwnam(account).pw_gid, "extra_groups": []}


def _behind(d: Path, targets: Sequence[Path]) -> Path:
    """The first of `targets` whose way (its links, its real path) goes through `d`."""
    for t in targets:
        if any(d == p or d in p.parents for p in [*links(t), Path(os.path.realpath(t))]):
            return t
    return targets[0]


def blocked(
    account: str,
    python: str,
    targets: Sequence[Path],
    dirs: Sequence[Path],
    imports: str,
    refused: dict[Path, str],
) -> str | None:
    """Why `account` cannot run `python -c 'import IMPORTS'` (one line), or None."""
    walk = subprocess.run(  # the first directory the account cannot enter, root first
        ["/bin/sh", "-c", 'for d do [ -x "$d" ] || { printf %s "$d"; exit 1; }; done', "sh"]
        + [str(d) for d in dirs],
        capture_output=True,
        text=True,
        timeout=60,
        **_as(account),
    )
    if walk.returncode != 0:
        d = Path(walk.stdout)
        st = d.stat()
        try:
            owner = pwd.getpwuid(st.st_uid).pw_name
        except KeyError:
            owner = str(st.st_uid)
        why = f"; chmod o+x refused: {refused[d]}" if d in refused else ""
        return (
            f"test account {account} cannot enter {d} (mode {st.st_mode & 0o7777:04o}, owner "
            f"{owner}{why}), on the way to {_behind(d, [Path(python), *targets])}: give every "
            f"account o+x on it (chmod o+x {d}), or put the checkout and its venv under a "
            "directory they can enter"
        )
    run = subprocess.run(
        [python, "-c", f"import {imports}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        **_as(account),
    )
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
        return (
            f"test account {account} cannot run {python} -c 'import {imports}' ({last}): "
            "make the checkout and its venv readable by every account (files o+r, "
            "directories o+rx; a clone made with umask 022 is)"
        )
    return None


@contextlib.contextmanager
def python_reachable(
    python: str = sys.executable,
    paths: Sequence[Path] = (REPO, Path(det_local.__file__).resolve().parent),
    *,
    imports: str = "det_local.cli.main",
    account: str = A,
    on_blocked: Callable[[str], NoReturn] = _raise,
) -> Iterator[None]:
    """`account` can run `python` (and import `imports` from `paths`) while this is held."""
    dirs = needed(python, paths)
    me = _me()
    with _state() as state:
        _settle(state)
        refused = _open(dirs, state, me)
        state["count"] += 1
        state["holders"][me] = state["holders"].get(me, 0) + 1
    try:
        key = (account, python, imports)
        if key not in _probed:
            line = blocked(account, python, paths, dirs, imports, refused)
            if line is not None:
                on_blocked(line)
            _probed.add(key)
        yield
    finally:
        with _state() as state:
            state["count"] -= 1
            n = state["holders"].get(me, 0) - 1
            if n > 0:
                state["holders"][me] = n
            else:
                state["holders"].pop(me, None)
            _settle(state)
