"""`det-local experiment`: list and describe experiments; pause, activate, kill, label them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from det_local.cli import attach
from det_local.cli.group import DetGroup
from det_local.cli.results import history
from det_local.cli.results.checkpoint import (
    JsonFlag,
    checkpoints_table,
    confirm,
    fmt_time,
    fmt_value,
)
from det_local.cli.trial import trials_table
from det_local.priority import HELP as PRIORITY_HELP

app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Experiments: create, list, describe, logs, wait, events, pause, activate, kill, label, "
    "set priority, archive, unarchive, delete.",
)
label_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode=None, help="Add or remove an experiment's labels."
)
set_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode=None, help="Change an experiment's settings."
)
app.add_typer(label_app, name="label", cls=DetGroup)
app.add_typer(set_app, name="set", cls=DetGroup)

ExperimentId = Annotated[int, typer.Argument(metavar="EXPERIMENT_ID", help="The experiment's id.")]


# ---------------------------------------------------------------------------- create
@app.command("create")
def create(
    config: Annotated[
        Path, typer.Argument(metavar="CONFIG", help="Experiment config (Determined's YAML).")
    ],
    context: Annotated[
        Path, typer.Argument(metavar="CONTEXT", help="Context directory: the code the trials run.")
    ],
    follow: Annotated[
        bool,
        typer.Option(
            "--follow", "-f", help="Stay and stream the trials' output to the end, as `run` does."
        ),
    ] = False,
    test: Annotated[
        bool, typer.Option("--test", help="Test mode, as `det-local run --test`.")
    ] = False,
    anywhere: Annotated[
        bool,
        typer.Option(
            "--anywhere",
            help="Its trials may run on an idle machine of the cluster when this one is full "
            "(as resources.federate: true): the config, context and hyperparameters travel "
            "to that machine, which reports the trials' output, metrics and exit status.",
        ),
    ] = False,
    config_edits: Annotated[
        list[str] | None,
        typer.Option(
            "--config",
            metavar="KEY=VALUE",
            help="A config edit laid over CONFIG, Determined's dotted keys, a YAML value "
            "(repeatable), checked as the file is: --config resources.resource_pool=hpc",
        ),
    ] = None,
    pool: Annotated[
        str | None,
        typer.Option(
            "--pool",
            metavar="NAME",
            help="The resource pool its trials run in: --config resources.resource_pool=NAME.",
        ),
    ] = None,
) -> None:
    """Submit an experiment to the running daemon and print its id (Determined's
    `det e create`); with -f, follow it as `det-local run` does (exit status as run's)."""
    from det_local import api
    from det_local.config.overrides import parse_overrides

    code = api.create_experiment(
        config,
        context,
        follow=follow,
        test_mode=test,
        anywhere=anywhere,
        overrides=parse_overrides(config_edits or []),
        pool=pool,
    )
    if code:
        raise typer.Exit(code)


# ---------------------------------------------------------------------------- reads
@app.command("list")
def list_experiments(
    all_users: Annotated[
        bool,
        typer.Option(
            "--all", "-a", help="Every user's experiments, archived ones included, not only yours."
        ),
    ] = False,
    archived: Annotated[
        bool, typer.Option("--archived", help="Archived experiments too (`experiment archive`).")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """List experiments (yours unless --all; archived ones only with --all or --archived),
    oldest first."""
    from det_local.cli.common import print_json, table
    from det_local.views import experiments as expviews

    shown = all_users or archived
    if as_json:
        print_json(expviews.experiments_json(all_users=all_users, archived=shown))
        return
    # configs are not read; the archived ones marked; others' counted for the hint
    exps, hidden, others = expviews.experiment_rows(all_users=all_users, archived=shown)
    rows = [
        [
            e.id,
            e.name,
            e.state.value + (" (archived)" if e.id in hidden else ""),
            _fmt_progress(e.progress),
            ",".join(e.labels),
            e.user,
            fmt_time(e.created_at),
            fmt_time(e.ended_at),
        ]
        for e in exps
    ]
    headers = ["ID", "Name", "State", "Progress", "Labels", "User", "Started", "Ended"]
    print(table(headers, rows, flex=("Name", "Labels", "User"), optional=("Ended",)))
    _others_hint(others)


def _others_hint(others: int) -> None:
    """On stderr (the table stays what a pipe reads): other users' experiments not listed."""
    if others:
        import sys

        word = "experiment" if others == 1 else "experiments"
        print(f"({others} {word} of other users not shown: --all lists them)", file=sys.stderr)


@app.command("describe")
def describe(experiment_id: ExperimentId, as_json: JsonFlag = False) -> None:
    """Show an experiment, its trials and its checkpoints."""
    from det_local import api
    from det_local.cli.common import print_json
    from det_local.views import experiments as expviews

    if as_json:
        print_json(expviews.experiment_json(experiment_id))
        return
    store = api.open_store()
    exp = store.get_experiment(experiment_id)
    trials = expviews.ranked_trials(store, experiment_id)
    rungs = expviews.trial_rungs(store, experiment_id)
    ckpts = store.list_checkpoints(experiment_id=experiment_id)
    cfg = exp.config
    fields: list[tuple[str, Any]] = [
        ("State", exp.state.value),
        ("Progress", _fmt_progress(exp.progress)),
        ("Labels", ", ".join(exp.labels)),
        ("Description", exp.description or ""),
        ("Message", exp.message or ""),
        ("User", exp.user),
        ("Started", fmt_time(exp.created_at)),
        ("Ended", fmt_time(exp.ended_at)),
        ("Searcher", _fmt_searcher(cfg.get("searcher"))),
        ("Entrypoint", _fmt_entrypoint(cfg.get("entrypoint"))),
        ("Slots/trial", _slots(cfg)),
        ("Context", exp.context_dir),
    ]
    from det_local.sched.warm.starttimes import summary

    starts = summary((warm, s) for _, _, warm, s in store.list_trial_starts(experiment_id))
    if starts:
        fields.append(("Trial start", starts))
    from det_local.tables import wrap_lines

    lines = wrap_lines(f"Experiment {exp.id}: ", exp.name, indent=0)
    for k, v in fields:
        lines += wrap_lines(f"{k + ':':<13}", str(v))
    lines += ["", "Trials (best first):", trials_table(store, trials, rungs)]
    lines += ["", "Checkpoints:", checkpoints_table(ckpts)]
    lines += ["", *history.best_lines(experiment_id)]
    print("\n".join(lines))


app.command("logs")(attach.experiment_logs)
app.command("wait")(attach.experiment_wait)
app.command("events")(history.experiment_events)


def _fmt_progress(progress: float | None) -> str:
    if progress is None or progress != progress:  # NaN
        return ""
    return f"{progress * 100:.1f}%"


def _fmt_length(length: Any) -> str:
    if isinstance(length, dict) and len(length) == 1:
        unit, n = next(iter(length.items()))
        return f"{n} {unit}"
    return fmt_value(length)


def _fmt_searcher(searcher: Any) -> str:
    if not isinstance(searcher, dict):
        return "" if searcher is None else fmt_value(searcher)
    parts = []
    if "metric" in searcher:
        better = "smaller" if searcher.get("smaller_is_better", True) else "larger"
        parts.append(f"metric {searcher['metric']}, {better} is better")
    for key in ("max_length", "max_trials", "max_concurrent_trials"):
        if searcher.get(key) is not None:
            parts.append(f"{key} {_fmt_length(searcher[key])}")
    name = str(searcher.get("name", "?"))
    return f"{name} ({'; '.join(parts)})" if parts else name


def _fmt_entrypoint(entrypoint: Any) -> str:
    if isinstance(entrypoint, list):
        return " ".join(str(a) for a in entrypoint)
    return "" if entrypoint is None else str(entrypoint)


def _slots(cfg: dict[str, Any]) -> Any:
    resources = cfg.get("resources")
    if isinstance(resources, dict) and resources.get("slots_per_trial") is not None:
        return resources["slots_per_trial"]
    return 1  # Determined's default


# ---------------------------------------------------------------------------- changes
def _control(experiment_id: int, action: str, **fields: object) -> None:
    from det_local.api import control

    print(control(experiment_id, action, **fields))


@app.command("pause")
def pause(experiment_id: ExperimentId) -> None:
    """Pause an experiment: its trials checkpoint and stop; `activate` resumes them."""
    _control(experiment_id, "pause")


@app.command("activate")
def activate(experiment_id: ExperimentId) -> None:
    """Resume a paused experiment."""
    _control(experiment_id, "activate")


@app.command("kill")
def kill(experiment_id: ExperimentId) -> None:
    """Stop an experiment's trials now, without a checkpoint; it ends CANCELED."""
    _control(experiment_id, "kill")


@label_app.command("add")
def label_add(
    experiment_id: ExperimentId,
    label: Annotated[str, typer.Argument(metavar="LABEL", help="The label to add.")],
) -> None:
    """Add a label to an experiment."""
    _control(experiment_id, "label_add", label=label)


@label_app.command("remove")
def label_remove(
    experiment_id: ExperimentId,
    label: Annotated[str, typer.Argument(metavar="LABEL", help="The label to remove.")],
) -> None:
    """Remove a label from an experiment."""
    _control(experiment_id, "label_remove", label=label)


@set_app.command("priority")
def set_priority(
    experiment_id: ExperimentId,
    priority: Annotated[int, typer.Argument(metavar="PRIORITY", help=PRIORITY_HELP)],
) -> None:
    """Set an experiment's priority (its trials' jobs move in the queue at once)."""
    _control(experiment_id, "set_priority", priority=priority)


@app.command("best")
def best(experiment_id: ExperimentId, as_json: JsonFlag = False) -> None:
    """The best trial by the searcher metric, and its checkpoint."""
    from det_local.cli.common import print_json
    from det_local.views.experiments import best_trial

    b = best_trial(experiment_id)
    if as_json:
        print_json(b)
        return
    from det_local.textsafe import visible

    t = b["trial"]
    print(f"Best trial of experiment {experiment_id}: trial {t['id']} ({t['state']})")
    print(f"  {visible(str(b['metric']))}: {b['best_validation']}")
    print(f"  hyperparameters: {visible(str(t['hparams']))}")
    c = b["checkpoint"]
    if c:
        where = visible(str(c["path"]))
        print(f"  checkpoint: {c['uuid']} (steps_completed={c['steps_completed']}) at {where}")
    else:
        print("  checkpoint: none recorded")


# ---------------------------------------------------------------------------- after the run
def _send(op: str, payload: dict[str, object]) -> None:
    from det_local.api import control_job

    print(control_job(op, payload))


@app.command("archive")
def archive(experiment_id: ExperimentId) -> None:
    """Archive an ended experiment: it leaves `experiment list` (shown with --all or
    --archived); nothing is deleted."""
    _send("experiment_archive", {"experiment_id": experiment_id})


@app.command("unarchive")
def unarchive(experiment_id: ExperimentId) -> None:
    """Bring an archived experiment back into `experiment list`."""
    _send("experiment_unarchive", {"experiment_id": experiment_id})


@app.command("delete")
def delete(
    experiment_id: ExperimentId,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete an ended experiment: its checkpoints (but those registered in a model), its
    logs, its context snapshot and its records. Refused while it runs."""
    from det_local.api import open_store
    from det_local.textsafe import visible

    exp = open_store().get_experiment(experiment_id)  # a clear error for an unknown id
    if not yes and not confirm(
        f"Delete experiment {experiment_id} ({visible(exp.name)}) with its checkpoints and logs?"
    ):
        print("aborted; nothing was deleted")
        raise typer.Exit(1)
    _send("experiment_delete", {"experiment_id": experiment_id})
