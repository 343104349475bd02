"""`det-local dashboard`: the process. Binds 127.0.0.1 unless told otherwise; every request
must carry the access token (guard.py): a fresh one, printed with the address to whoever
started it, or, for the daemon's dashboard, the one the daemon wrote to a file
(web/supervisor.py)."""

from __future__ import annotations

import secrets
import socket
import sys
from pathlib import Path

from det_local.errors import DetLocalError
from det_local.store.paths import Paths
from det_local.web.guard import STANDALONE_HINT, is_loopback


def address(host: str, port: int, token: str | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    if host in ("0.0.0.0", "::"):
        shown = socket.gethostname()
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")


def daemon_address(paths: Paths) -> str:
    """`det-local dashboard --url`: the address of the daemon's dashboard with its token;
    DetLocalError (one line) when there is none or its token cannot be read."""
    from det_local.web.supervisor import load_dashboard_settings, token_path

    settings = load_dashboard_settings(paths.settings)
    path = token_path(paths.run_dir)
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        if not settings.enabled:
            raise DetLocalError(
                f"no dashboard serves {paths.home} for everyone: {paths.settings} has no "
                f"`dashboard:` section and there is no {path} (the systemd unit writes it); "
                "start one of your own with `det-local dashboard`"
            ) from None
        raise DetLocalError(
            f"no dashboard token in {path}: is the daemon of {paths.home} running? "
            "(`det-local daemon status`)"
        ) from None
    except OSError as err:
        raise DetLocalError(f"cannot read the dashboard's token {path}: {err.strerror}") from None
    check_holder(settings.host, settings.port, path)
    return address(settings.host, settings.port, token)


def check_holder(host: str, port: int, token_file: Path) -> None:
    """DetLocalError when another user's process listens on the daemon dashboard's port (one
    squatting it while the dashboard restarts): the login address would hand it the token.
    The dashboard's socket is made by the daemon's user (root binds it before switching), the
    owner of the token file."""
    from det_local.web.portholder import holders, user_name

    try:
        owner = token_file.stat().st_uid
    except OSError:
        return
    for holder in holders(port, host):
        if holder.listener.uid != owner and holder.collides(host):
            raise DetLocalError(
                f"the daemon's dashboard port {host}:{port} is held by {holder.describe()}, "
                f"not by the dashboard (whose socket is {user_name(owner)}'s): its login "
                "address is not printed (it would hand that process the token); tell the "
                "daemon's admin (the daemon's log names the holder)"
            )


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
        from det_local.web.portholder import held_by

        held = held_by(port, host) if port else ""
        raise DetLocalError(
            f"the dashboard cannot listen on {host}:{port}: {err.strerror}"
            + (f" ({held})" if held else "")
            + "; choose another with --port (or --host)"
        ) from None
    sock.listen(BACKLOG)
    return sock


def preload() -> None:
    """Import now what the pages import when first asked, for a dashboard that switches to
    an unprivileged user next (its Python may sit where that user cannot read; the modules
    det_local/web/ and views/ import inside functions: tests/web/test_dashboard_preload.py)."""
    import difflib  # noqa: F401
    import urllib.parse  # noqa: F401

    import anyio._backends._asyncio  # noqa: F401  (anyio finds its backend when first asked)
    import anyio.to_thread  # noqa: F401
    import msgpack  # noqa: F401
    import psutil  # noqa: F401
    import yaml  # noqa: F401

    import det_local.client.attach  # noqa: F401
    import det_local.client.follow  # noqa: F401
    import det_local.client.queueview  # noqa: F401
    import det_local.client.requester  # noqa: F401
    import det_local.client.searchsummary  # noqa: F401
    import det_local.client.slotview  # noqa: F401
    import det_local.client.taskview  # noqa: F401
    import det_local.config  # noqa: F401
    import det_local.federate.client  # noqa: F401
    import det_local.pools  # noqa: F401
    import det_local.sched.extensions  # noqa: F401
    import det_local.sched.intake.inotify  # noqa: F401  (ctypes)
    import det_local.sched.intake.spool  # noqa: F401
    import det_local.sched.queue.policy  # noqa: F401  (client/queueview, when first asked)
    import det_local.sched.settings  # noqa: F401
    import det_local.search  # noqa: F401
    import det_local.store.logtail  # noqa: F401
    import det_local.tables  # noqa: F401
    import det_local.usage.gpus  # noqa: F401  (client/slotview, when first asked)
    import det_local.usage.readers  # noqa: F401
    import det_local.views.cluster  # noqa: F401
    import det_local.web.live  # noqa: F401
    import det_local.web.portholder  # noqa: F401  (web/supervisor, a taken port)
    import det_local.wire.rpc  # noqa: F401


DAEMON_HINT = (
    "run `det-local dashboard --url` on this machine and open the address it prints "
    "(it ends ?token=...)"
)
BACKLOG = 2048  # connections waiting to be accepted (beyond, the kernel drops: a 1 s retry)
MAX_CONNECTIONS = 4096  # the last bound on open connections (uvicorn answers 503 beyond); the
# streams' own caps (live.py) refuse floods long before it, with their one line


def read_token(path: Path) -> str:
    """The token the daemon wrote for its dashboard (web/supervisor.py); one line errors."""
    try:
        token = path.read_text().strip()
    except OSError as err:
        raise DetLocalError(f"cannot read the dashboard's token {path}: {err.strerror}") from None
    if len(token) < 16:
        raise DetLocalError(f"the dashboard's token file {path} holds no token")
    return token


def more_files() -> int:
    """The soft limit on open files up to its hard limit (streams and their clients); returns
    how many connections may be open at once below it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 65536) if hard != resource.RLIM_INFINITY else 65536
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    room = 65536 if soft == resource.RLIM_INFINITY else soft - 64  # the log, the pool, ...
    return max(64, min(MAX_CONNECTIONS, room))


def serve(
    host: str,
    port: int,
    *,
    user: str | None = None,
    exit_fd: int | None = None,
    token_file: Path | None = None,
) -> None:
    """Run the dashboard until Ctrl-C (or SIGTERM). user: started as root, switch to this
    user once the port is bound; exit_fd: end when that pipe reaches EOF (the daemon that
    started this one has gone: web/supervisor.py); token_file: the access token is the one
    in this file (the daemon's dashboard), else a fresh one printed with the address."""
    from det_local.web import require_web

    require_web()
    import os

    import uvicorn

    from det_local.api import paths
    from det_local.web.app import create_app
    from det_local.web.pool import install, limit_threads
    from det_local.web.supervisor import drop_to, exit_with

    if user is not None and os.geteuid() != 0:
        raise DetLocalError(
            f"--user {user}: only a dashboard started as root switches user; leave --user out"
        )
    token = read_token(token_file) if token_file else secrets.token_urlsafe(24)
    sock = bind(host, port)
    port = int(sock.getsockname()[1])  # --port 0: the one the system chose
    connections = more_files()
    app = create_app(
        token=token,
        loopback_only=is_loopback(host),
        port=port,
        hint=DAEMON_HINT if token_file else STANDALONE_HINT,
        on_start=limit_threads,
    )
    home = paths()
    install(home)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=1,
        limit_concurrency=connections,
    )
    if user is not None:
        preload()
        # uvicorn imports its protocol, lifespan and loop modules when it starts serving
        config.load()
        config.get_loop_factory()
        drop_to(user)
    if exit_fd is not None:
        exit_with(exit_fd)
    if token_file:
        print(f"det-local dashboard of {home.home}: {address(host, port, None)}", flush=True)
        print(
            f"  its access token is in {token_file}: `det-local dashboard --url` prints the "
            "address with it",
            flush=True,
        )
    else:
        print(f"det-local dashboard of {home.home}: {address(host, port, token)}", flush=True)
        print(
            "  open the address above (the browser keeps the token for this address alone); "
            "scripts send the header 'Authorization: Bearer TOKEN'",
            flush=True,
        )
    if is_loopback(host):
        print(
            f"  from another machine: ssh -L {port}:127.0.0.1:{port} THIS_HOST, "
            "then open the address above there, as it is",
            flush=True,
        )
    if user is not None:
        print(f"  serving as user {user}", flush=True)
    sys.stdout.flush()
    uvicorn.Server(config).run(sockets=[sock])
