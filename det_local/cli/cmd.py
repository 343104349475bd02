"""`det-local cmd run|list|logs|kill`: any command on slots (what task-spooler is used for)."""

from __future__ import annotations

import typer

from det_local.priority import DEFAULT_PRIORITY
from det_local.priority import HELP as PRIORITY_HELP

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
    pool: str = typer.Option(
        None,
        "--pool",
        help="The resource pool it runs in (`det-local slots` lists them; default: this "
        "machine's slots). In a Slurm pool it is one batch job.",
    ),
    anywhere: bool = typer.Option(
        False,
        "--anywhere",
        help="It may run on an idle machine of the cluster when this one is full: its command "
        "line (arguments included: no secrets in them) and working directory travel to that "
        "machine, which runs it with a clean environment and reports its output and exit "
        "status (`cmd list` says from where).",
    ),
    config: list[str] = typer.Option(
        None,
        "--config",
        metavar="KEY=VALUE",
        help="Determined's task config: idle_timeout=30m (idle slots past it are flagged, "
        "or ended per daemon.yaml's idle_policy).",
    ),
) -> None:
    """Queue a command: `det-local cmd run --slots 1 -- python3 eval.py --fast`.

    Its output goes to a log (`det-local cmd logs ID`); its exit status is recorded. With no
    daemon running, -f runs it here (an engine in this process, as `det-local run` does);
    without -f it waits in the queue until a daemon starts."""
    import os

    from det_local import api
    from det_local.priority import check_priority, check_slots
    from det_local.sched.run.userfiles import current_umask
    from det_local.usage.settings import parse_task_config

    check_slots(slots)
    check_priority(priority)
    task_config = parse_task_config(config)
    argv = list(ctx.args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    payload = {
        **task_config,
        "argv": argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "slots": slots,
        "priority": priority,
        "name": name,
        "umask": current_umask(),  # it runs with this shell's umask, as if run here
        "anywhere": anywhere,
        **({"pool": pool} if pool else {}),
    }
    if follow:
        from det_local.client.embedded import run_command

        raise typer.Exit(run_command(api.paths(), payload))
    job_id = api.control_job("cmd_run", payload)
    print(f"Queued command {job_id}", flush=True)
    from det_local.sched.enginelock import lock_free

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
    from det_local.store.states import JobKind
    from det_local.views import cluster as clusterviews

    if as_json:
        print_json(clusterviews.commands_json(include_done=show_all))
        _hidden_hint(show_all)
        return
    jobs = [j for j in api.open_store().jobs.list(include_done=show_all) if j.kind != JobKind.TRIAL]
    from det_local.cli.results.checkpoint import fmt_time

    rows = [
        [
            j.id,
            j.state,
            _exit(j.exit_code, clusterviews.ran_on(j)),
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
    # idle reservations (issue 30): the listed jobs', and those stopped in the last day
    import time

    recent = [
        j.id
        for j in api.open_store().jobs.list(include_done=True)
        if j.kind != JobKind.TRIAL and (j.ended_at is None or j.ended_at > time.time() - 86400)
    ]
    for line in clusterviews.idle_notes(sorted({*recent, *(j.id for j in jobs)})).values():
        print(line)
    _hidden_hint(show_all)


def _hidden_hint(show_all: bool) -> None:
    """On stderr (so --json stays JSON): how many ended commands the list left out."""
    if show_all:
        return
    import sys

    from det_local.views import cluster as clusterviews

    ended = clusterviews.ended_commands()
    if ended:
        word = "command" if ended == 1 else "commands"
        print(
            f"({ended} ended {word} not shown; `det-local cmd list --all` lists them)",
            file=sys.stderr,
        )


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


@app.command("metrics")
def metrics(
    job_id: int = typer.Argument(..., metavar="JOB_ID", help="The command's job id."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    as_csv: bool = typer.Option(False, "--csv", help="Print CSV."),
) -> None:
    """A command's (notebook's, shell's) system metrics as the daemon sampled them: GPU
    utilisation and memory per slot, CPU, memory and disk I/O of its processes."""
    from det_local.cli.results.history import metrics_table, write_csv
    from det_local.errors import DetLocalError
    from det_local.views import cluster as clusterviews

    if as_json and as_csv:
        raise DetLocalError("--json and --csv: choose one")
    reports = clusterviews.system_metrics(job_id=job_id)
    if as_json:
        from det_local.cli.common import print_json

        print_json([r.to_json() for r in reports])
    elif as_csv:
        write_csv(reports)
    else:
        print(metrics_table(reports, with_group=False))
