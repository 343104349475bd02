"""What runs inside a trial: Determined's top-level names (det.InvalidHP, get_cluster_info...)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from det_local.wire.trialinfo import (
    ClusterInfo,
    RendezvousInfo,
    ResourcesInfo,
    TrialInfo,
    get_cluster_info,
)

LOG_FORMAT = "%(levelname)s: [%(process)s] %(name)s: %(message)s"


class InvalidHP(Exception):
    """Raise inside ``with core.init()`` to end the trial early: its hyperparameters are invalid."""

    def __init__(self, msg: str = "...") -> None:
        super().__init__(msg)


_importing = False


@contextlib.contextmanager
def import_from_path(path: str | os.PathLike[str]) -> Iterator[None]:
    """Import modules from ``path`` (a checkpoint's code/ dir) without disturbing sys.modules.

    Modules already imported from the current directory are hidden meanwhile; modules imported
    from ``path`` are removed on exit; no __pycache__ is written. Not re-entrant."""
    global _importing
    if _importing:
        raise RuntimeError("import_from_path is not re-entrant")
    _importing = True
    path = os.path.abspath(os.fspath(path))
    cwd = os.path.abspath(os.getcwd())

    def _from(mod: object, root: str) -> bool:
        f = getattr(mod, "__file__", None)
        return bool(f) and os.path.abspath(str(f)).startswith(root + os.sep)

    hidden = {n: m for n, m in sys.modules.items() if _from(m, cwd) and not _from(m, path)}
    for name in hidden:
        del sys.modules[name]
    old_path = list(sys.path)
    old_bytecode = sys.dont_write_bytecode
    sys.path.insert(0, path)
    sys.dont_write_bytecode = True
    try:
        yield
    finally:
        for name in [n for n, m in sys.modules.items() if _from(m, path)]:
            del sys.modules[name]
        sys.modules.update(hidden)
        sys.path[:] = old_path
        sys.dont_write_bytecode = old_bytecode
        _importing = False


__all__ = [
    "LOG_FORMAT",
    "ClusterInfo",
    "InvalidHP",
    "RendezvousInfo",
    "ResourcesInfo",
    "TrialInfo",
    "get_cluster_info",
    "import_from_path",
]
