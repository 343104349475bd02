"""A Python the test users can run det-local with.

This machine's interpreter may live where other users cannot go (pyenv under /root, mode
0700; the test venv links to it), and CI's clone may be anywhere. ``user_python`` builds, once
per session, a venv from the system's own interpreter (Debian's ``/usr/bin/python3``, same minor
version, so the same ABI as the compiled dependencies) in a world-readable temporary directory,
with a copy of det_local (and its ``determined`` compat package) and of det-local's runtime
dependency closure (``importlib.metadata`` requirements of det-local, recursively, extras left
out: no torch). Everything in it is world-readable; it is removed at the end of the session.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import det_local

SYSTEM_PYTHON = "/usr/bin/python3"


def closure(root: str = "det-local") -> list[metadata.Distribution]:
    """The installed distributions det-local needs at run time (its requirements without
    extras, recursively)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = [root]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        dist = metadata.distribution(name)
        seen[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            todo.append(req.name)
    del seen[canonicalize_name(root)]  # det_local itself is copied from the tree under test
    return list(seen.values())


def _copy_dist(dist: metadata.Distribution, site: Path) -> None:
    base = Path(str(dist.locate_file(""))).resolve()
    for rel in dist.files or []:
        src = (base / rel).resolve()
        try:
            src.relative_to(base)
        except ValueError:
            continue  # a console script in bin/: not needed
        if "__pycache__" in rel.parts or not src.is_file():
            continue
        dst = site / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)


def _open_up(root: Path) -> None:
    """Directories 0755, files 0644 (0755 where executable): readable by every user."""
    for dirpath, _, files in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in files:
            path = Path(dirpath) / name
            if path.is_symlink():
                continue
            mode = path.stat().st_mode
            os.chmod(path, 0o755 if mode & 0o111 else 0o644)


def build(where: Path) -> Path:
    """The venv in `where`; returns its python."""
    venv = where / "venv"
    subprocess.run(
        [SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True
    )
    python = venv / "bin" / "python3"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    for dist in closure():
        _copy_dist(dist, site)
    package = Path(det_local.__file__).resolve().parent
    shutil.copytree(package, site / "det_local", ignore=shutil.ignore_patterns("__pycache__"))
    # `import determined` as an install of det-local provides it (trials put compat/ first
    # on PYTHONPATH too: this is for when that directory is out of the users' reach)
    (site / "det_local_compat.pth").write_text(str(site / "det_local" / "compat") + "\n")
    _open_up(where)
    return python


def usable() -> str | None:
    """Why no user Python can be built here (None: it can)."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"{SYSTEM_PYTHON} is missing"
    r = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
    )
    mine = "{}.{}".format(*sys.version_info[:2])
    if r.returncode != 0 or r.stdout.strip() != mine:
        return f"{SYSTEM_PYTHON} is not Python {mine} (the ABI of this venv's packages)"
    return None


@pytest.fixture(scope="session")
def user_python() -> Iterator[Path]:
    why = usable()
    if why is not None:
        pytest.skip(why)
    where = Path(tempfile.mkdtemp(prefix="det-local-userpy-", dir="/tmp"))
    try:
        os.chmod(where, 0o755)
        yield build(where)
    finally:
        shutil.rmtree(where, ignore_errors=True)
