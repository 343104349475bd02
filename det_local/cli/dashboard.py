"""`det-local dashboard`: the web view (det_local/web/, the `det-local[web]` extra). Top level
imports typer only: Starlette and uvicorn load when the command runs."""

from __future__ import annotations

import typer


def dashboard_command(
    host: str = typer.Option(
        "127.0.0.1",
        "--host",
        help="Address to listen on. Anything but the loopback requires the access token "
        "printed at start.",
    ),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port to listen on."),
    user: str = typer.Option(
        None,
        "--user",
        help="Started as root: bind the port, then run as this unprivileged user "
        "(what the daemon does with daemon.yaml's dashboard.user).",
    ),
    url: bool = typer.Option(
        False,
        "--url",
        help="Print the address (with its access token) of the dashboard the daemon runs "
        "(daemon.yaml's dashboard:), and exit.",
    ),
    exit_fd: int = typer.Option(
        None, "--exit-with-fd", hidden=True, help="Exit when this pipe closes (the daemon's)."
    ),
    token_file: str = typer.Option(
        None, "--token-file", hidden=True, help="The access token is in this file (the daemon's)."
    ),
) -> None:
    """Serve the dashboard (read-only): experiments, learning curves, trials and their logs,
    the queue and the slots, with a JSON API under /api/. Every request needs the access
    token printed at start: open the address it prints. Needs the `web` extra."""
    if url:
        from det_local.api import paths
        from det_local.web.serve import daemon_address

        print(daemon_address(paths()))
        return
    from pathlib import Path

    from det_local.web.serve import serve

    try:
        serve(
            host,
            port,
            user=user,
            exit_fd=exit_fd,
            token_file=Path(token_file) if token_file else None,
        )
    except KeyboardInterrupt:
        pass
