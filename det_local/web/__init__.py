"""The dashboard (`det-local dashboard`): read-only pages and a JSON API under /api/ over the
same `det_local.api` functions the CLI's --json uses. A separate process; it reads the store
read-only and the trials' log files, with or without a daemon running.

Starlette and uvicorn come with the optional extra `det-local[web]`; nothing here is imported
by the rest of det-local but `supervisor` and `portholder` (which import neither: the daemon
runs the dashboard through the first). Modules: `app` (the application and its routes'
table), `guard` (the access token on every request, and the loopback Host check), `pool` (the
SQLite handles), `jsonapi` (/api/), `pages` and `html` (the server-rendered pages), `cluster`
and `commands` (those pages and their /api/ routes), `live` (server-sent events, bounded),
`serve` (the process), `supervisor` (daemon.yaml's `dashboard:`, the daemon's child, its token
file), `portholder` (who holds a port: the supervisor's line when another process has the
dashboard's), and `static/sw.js` + `static/login.js` (the browser's login: the token kept for
the dashboard's origin, sent as a header by a service worker).
"""

from __future__ import annotations

from det_local.errors import DetLocalError

INSTALL_HINT = "pip install 'det-local[web]'"


def install_hint(package: str | None = None) -> str:
    """How to add the web extra to this det-local (whose det_local/ is `package`): from a
    source checkout (an editable install, or PYTHONPATH) `pip install -e '.[web]'` in it, else
    from the package index."""
    from pathlib import Path

    root = Path(package or Path(__file__).resolve().parent.parent).parent
    if (root / "pyproject.toml").is_file() and (root / "det_local").is_dir():
        return f"cd {root} && pip install -e '.[web]' (a source checkout)"
    return INSTALL_HINT


def require_web() -> None:
    """A one-line error when Starlette or uvicorn cannot be imported."""
    import sys

    missing = []
    for name in ("starlette", "uvicorn"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise DetLocalError(
            f"the dashboard needs {' and '.join(missing)}, which this Python "
            f"({sys.executable}) lacks: {install_hint()}"
        )
