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
) -> None:
    """Serve the dashboard (read-only): experiments, learning curves, trials and their logs,
    the queue and the slots, with a JSON API under /api/. Needs `pip install 'det-local[web]'`."""
    from det_local.web.serve import serve

    try:
        serve(host, port)
    except KeyboardInterrupt:
        pass
