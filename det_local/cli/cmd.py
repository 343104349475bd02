"""`det-local cmd run|list|logs|kill`: any command on slots (what task-spooler is used for)."""

from __future__ import annotations

import typer

from det_local.sched.priority import DEFAULT_PRIORITY
from det_local.sched.priority import HELP as PRIORITY_HELP

app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Commands on slots.")


@app.command(
    "run",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def run(
    ctx: typer.Context,
    slots: int = typer.Option(1, "--slots", help="Slots (GPUs, or CPU slots) the command needs."),
    priority: int = typer.Option(DEFAULT_PRIORITY, "--priority", "-p", help=PRIORITY_HELP),
    name: str = typer.Option(None, "--name", help="A name for `job list`."),
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Wait for it and stream its output; exit with its status."
    ),
    anywhere: bool = typer.Option(
        False,
        "--anywhere",
        help="It may run on an idle machine of the cluster when this one is full: its command "
        "line (arguments included: no secrets in them) and working directory travel to that "
        "machine, which runs it with a clean environment and reports its output and exit "
        "status (`cmd list` says from where).",
    ),
) -> None:
    """Queue a command: `det-local cmd run --slots 1 -- python3 eval.py --fast`.

    Its output goes to a log (`det-local cmd logs ID`); its exit status is recorded. With no
    daemon running, -f runs it here (an engine in this process, as `det-local run` does);
    without -f it waits in the queue until a daemon starts."""
    import os

    from det_local import api
    from det_local.sched.userfiles import current_umask

    argv = list(ctx.args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    payload = {
        "argv": argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "slots": slots,
        "priority": priority,
        "name": name,
        "umask": current_umask(),  # it runs with this shell's umask, as if run here
        "anywhere": anywhere,
    }
    if follow:
        from det_local.sched.embedded import run_command

        raise typer.Exit(run_command(api.paths(), payload))
    job_id = api.control_job("cmd_run", payload)
    print(f"Queued command {job_id}", flush=True)
    from det_local.sched.control import lock_free

    p = api.paths()
    if lock_free(p):
        import sys

        print(
            f"det-local: no daemon is running for {p.home}; command {job_id} waits in the "
            "queue until one starts (`det-local daemon start`), or run it now in this "
            "terminal with `det-local cmd run -f`",
            file=sys.stderr,
            flush=True,
        )


@app.command("list")
def list_commands(
    show_all: bool = typer.Option(False, "--all", "-a", help="Include ended commands."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Commands: queued, running and (with --all) ended, with their exit status and their
    start and end times."""
    from det_local import api
    from det_local.cli.common import print_json, table

    if as_json:
        print_json(api.commands_json(include_done=show_all))
        return
    jobs = [j for j in api.open_store().jobs.list(include_done=show_all) if j.kind != "TRIAL"]
    from det_local.cli.checkpoint import fmt_time

    rows = [
        [
            j.id,
            j.state,
            _exit(j.exit_code, api.ran_on(j)),
            j.slots_needed,
            j.user,
            fmt_time(j.started_at),
            fmt_time(j.ended_at),
            j.name,
        ]
        for j in jobs
    ]
    headers = ["ID", "State", "Exit", "Slots", "User", "Started", "Ended", "Command"]
    print(table(headers, rows, flex=("User", "Command"), optional=("Ended", "Started")))


def _exit(code: int | None, peer: str | None) -> str:
    """The exit column; a status a peer reported says so (its output came from there too)."""
    text = "" if code is None else str(code)
    return f"{text} (from {peer})".strip() if peer else text


@app.command("logs")
def logs(
    job_id: int = typer.Argument(..., metavar="JOB_ID", help="The command's job id."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Follow until it ends."),
) -> None:
    """A command's output."""
    from det_local import api

    if follow:
        raise typer.Exit(api.follow_command(job_id))
    store = api.open_store()
    store.jobs.get(job_id)
    path = api.paths().command_log(job_id)
    if path.exists():
        print(path.read_text(errors="replace"), end="")


@app.command("kill")
def kill(job_id: int = typer.Argument(..., metavar="JOB_ID", help="The command's job id.")) -> None:
    """Stop a command (SIGTERM to its process group, then SIGKILL), or drop it from the queue."""
    from det_local import api

    print(api.control_job("cmd_kill", {"job_id": job_id}))
