"""`det-local daemon [start|stop|status]`."""

from __future__ import annotations

import typer

app = typer.Typer(
    rich_markup_mode=None,
    invoke_without_command=True,
    help="The per-machine daemon. With no subcommand it runs in the foreground.",
)


@app.callback()
def daemon(ctx: typer.Context) -> None:
    """Run the daemon in the foreground (`det-local daemon`), or manage it in the background."""
    if ctx.invoked_subcommand is not None:
        return
    from det_local import api
    from det_local.federate.service import extension as federation
    from det_local.sched.daemon import run_foreground
    from det_local.sched.extensions import ExtensionFactory
    from det_local.usage.sampler import extension as system_metrics
    from det_local.usage.settings import load_usage_settings
    from det_local.web.supervisor import extension as dashboard
    from det_local.web.supervisor import load_dashboard_settings

    paths = api.paths()
    usage = load_usage_settings(paths.settings)  # a bad field: one line, no daemon
    extensions: list[ExtensionFactory] = [federation, system_metrics(usage)]
    board = load_dashboard_settings(paths.settings)  # a bad section: one line, no daemon
    if board.enabled:
        extensions.append(dashboard(board))
    raise typer.Exit(run_foreground(paths, extensions=extensions))


@app.command("start")
def start() -> None:
    """Start the daemon in the background (logs: DET_LOCAL_HOME/run/daemon.log)."""
    from det_local import api
    from det_local.client.daemonctl import start_background

    info = start_background(api.paths())
    print(f"det-local daemon {info.pid} serving {info.home}")


@app.command("stop")
def stop() -> None:
    """Stop the daemon. Running jobs keep running and are adopted at the next start."""
    from det_local import api
    from det_local.client.daemonctl import stop as stop_daemon

    print(stop_daemon(api.paths()))


@app.command("status")
def status(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Whether the daemon runs, its pid, uptime, memory, and the queue's size."""
    from det_local.cli import hot

    code = hot.daemon_status(as_json)
    if code:
        raise typer.Exit(code)
