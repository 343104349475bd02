"""`det-local dashboard`: the process. Binds 127.0.0.1 unless told otherwise; any other
address gets a fresh access token, printed with the address, that every request must carry."""

from __future__ import annotations

import secrets
import socket
import sys

from det_local.errors import DetLocalError
from det_local.web.guard import is_loopback


def address(host: str, port: int, token: str | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    if host in ("0.0.0.0", "::"):
        shown = socket.gethostname()
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (bound now, before any change of user: a port below 1024 works
    for a dashboard started as root); a one-line error when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise DetLocalError(
            f"the dashboard cannot listen on {host}:{port}: {err.strerror}; "
            "choose another with --port (or --host)"
        ) from None
    sock.listen(128)
    return sock


def preload() -> None:
    """Import now what the pages import when first asked, for a dashboard that switches to
    an unprivileged user next (its Python may sit where that user cannot read)."""
    import difflib  # noqa: F401
    import urllib.parse  # noqa: F401

    import msgpack  # noqa: F401
    import psutil  # noqa: F401
    import yaml  # noqa: F401

    import det_local.config  # noqa: F401
    import det_local.federate.client  # noqa: F401
    import det_local.rpc  # noqa: F401
    import det_local.sched.attach  # noqa: F401
    import det_local.sched.inotify  # noqa: F401  (ctypes)
    import det_local.sched.queueview  # noqa: F401
    import det_local.sched.requester  # noqa: F401
    import det_local.sched.searchsummary  # noqa: F401
    import det_local.sched.settings  # noqa: F401
    import det_local.sched.slotview  # noqa: F401
    import det_local.sched.spool  # noqa: F401
    import det_local.sched.taskview  # noqa: F401
    import det_local.search  # noqa: F401
    import det_local.store.logtail  # noqa: F401
    import det_local.web.live  # noqa: F401


def serve(host: str, port: int, *, user: str | None = None, exit_fd: int | None = None) -> None:
    """Run the dashboard until Ctrl-C (or SIGTERM). user: started as root, switch to this
    user once the port is bound; exit_fd: end when that pipe reaches EOF (the daemon that
    started this one has gone: web/supervisor.py)."""
    from det_local.web import require_web

    require_web()
    import os

    import uvicorn

    from det_local.api import paths
    from det_local.web.app import create_app
    from det_local.web.supervisor import drop_to, exit_with

    if user is not None and os.geteuid() != 0:
        raise DetLocalError(
            f"--user {user}: only a dashboard started as root switches user; leave --user out"
        )
    token = None if is_loopback(host) else secrets.token_urlsafe(24)
    sock = bind(host, port)
    port = int(sock.getsockname()[1])  # --port 0: the one the system chose
    app = create_app(token=token)
    if user is not None:
        preload()
        drop_to(user)
    if exit_fd is not None:
        exit_with(exit_fd)
    print(f"det-local dashboard of {paths().home}: {address(host, port, token)}", flush=True)
    if token:
        print(
            f"  listening on {host}: every request needs the token above "
            "(header 'Authorization: Bearer TOKEN' or ?token=TOKEN)",
            flush=True,
        )
    else:
        print(
            f"  from another machine: ssh -L {port}:127.0.0.1:{port} THIS_HOST, "
            f"then open http://localhost:{port}/",
            flush=True,
        )
    if user is not None:
        print(f"  serving as user {user}", flush=True)
    sys.stdout.flush()
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=1,
    )
    uvicorn.Server(config).run(sockets=[sock])
