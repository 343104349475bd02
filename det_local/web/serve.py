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


def check_port(host: str, port: int) -> None:
    """A one-line error now, rather than uvicorn's log lines, when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            raise DetLocalError(
                f"the dashboard cannot listen on {host}:{port}: {err.strerror}; "
                "choose another with --port (or --host)"
            ) from None


def serve(host: str, port: int) -> None:
    """Run the dashboard until Ctrl-C."""
    from det_local.web import require_web

    require_web()
    import uvicorn

    from det_local.api import paths
    from det_local.web.app import create_app

    token = None if is_loopback(host) else secrets.token_urlsafe(24)
    check_port(host, port)
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
    sys.stdout.flush()
    uvicorn.run(
        create_app(token=token),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=1,
    )
