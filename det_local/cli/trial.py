"""`det-local trial`: list and describe trials, print and follow their logs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from det_local.cli.results.checkpoint import JsonFlag, checkpoints_table, fmt_time, fmt_value
from det_local.cli.results.history import trial_metrics
from det_local.tables import flatten

if TYPE_CHECKING:
    from det_local.store.db import Store
    from det_local.store.records import MetricRecord, TrialRecord

app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Trials: list, describe, metrics, logs, kill.",
)
app.command("metrics")(trial_metrics)

TRAINING = "training"
VALIDATION = "validation"


# ---------------------------------------------------------------------------- shared formatting
def fmt_metrics(metrics: dict[str, Any] | None) -> str:
    if not metrics:
        return ""
    return " ".join(f"{k}={fmt_value(v)}" for k, v in metrics.items())


def trials_table(
    store: Store, trials: Iterable[TrialRecord], rungs: dict[int, int] | None = None
) -> str:
    """Trials with hparams and their latest validation metrics (one small query per trial);
    a Rung column for ASHA searches."""
    from det_local.cli.common import table

    rows = []
    for t in trials:
        latest = store.latest_metrics(t.id, VALIDATION)
        row = [
            t.id,
            t.state.value,
            t.steps_completed,
            t.restarts,
            "" if t.best_validation is None else fmt_value(t.best_validation),
            fmt_metrics(latest.metrics if latest else None),
            fmt_metrics(dict(flatten(t.hparams))),
            t.latest_checkpoint or "",
        ]
        if rungs:
            row.insert(3, "" if rungs.get(t.id) is None else rungs[t.id])
        rows.append(row)
    headers = ["ID", "State", "Steps", "Restarts", "Best Validation", "Latest Validation"]
    headers += ["Hyperparameters", "Checkpoint"]
    if rungs:
        headers.insert(3, "Rung")
    wide = ("Latest Validation", "Hyperparameters", "Checkpoint")
    # the checkpoints are listed in full under this table
    return table(headers, rows, flex=wide, optional=("Checkpoint",))


# ---------------------------------------------------------------------------- list / describe
@app.command("list")
def list_trials(
    experiment_id: Annotated[
        int, typer.Argument(metavar="EXPERIMENT_ID", help="The experiment's id.")
    ],
    as_json: JsonFlag = False,
) -> None:
    """List an experiment's trials."""
    from det_local.api import open_store
    from det_local.cli.common import print_json, table

    store = open_store()
    store.get_experiment(experiment_id)  # a clear error for an unknown id
    trials = store.list_trials(experiment_id)
    if as_json:
        print_json([t.to_json() for t in trials])
        return
    rows = [
        [
            t.id,
            t.state.value,
            t.steps_completed,
            t.restarts,
            "" if t.best_validation is None else fmt_value(t.best_validation),
            t.latest_checkpoint or "",
            fmt_metrics(dict(flatten(t.hparams))),
            fmt_time(t.created_at),
            fmt_time(t.ended_at),
        ]
        for t in trials
    ]
    headers = ["ID", "State", "Steps", "Restarts", "Best Validation", "Checkpoint"]
    headers += ["Hyperparameters", "Started", "Ended"]
    wide = ("Checkpoint", "Hyperparameters")
    print(table(headers, rows, flex=wide, optional=("Ended", "Started")))


@app.command("describe")
def describe(
    trial_id: Annotated[int, typer.Argument(metavar="TRIAL_ID", help="The trial's id.")],
    as_json: JsonFlag = False,
) -> None:
    """Show a trial: state, hyperparameters, latest metrics and checkpoints."""
    from det_local import api
    from det_local.cli.common import print_json
    from det_local.pools import pool_job
    from det_local.tables import wrap_lines
    from det_local.textsafe import visible
    from det_local.views import experiments as expviews

    if as_json:
        print_json(expviews.trial_json(trial_id))
        return
    store = api.open_store()
    t = store.get_trial(trial_id)
    training = store.latest_metrics(trial_id, TRAINING)
    validation = store.latest_metrics(trial_id, VALIDATION)
    ckpts = store.list_checkpoints(trial_id=trial_id)
    lines = [
        f"Trial {t.id} of experiment {t.experiment_id}",
        f"  State:             {t.state.value}",
        f"  Steps completed:   {t.steps_completed}",
        f"  Restarts:          {t.restarts}",
        f"  Runs:              {t.run_id}",
        f"  Seed:              {t.seed}",
        "  Best validation:   "
        + ("" if t.best_validation is None else fmt_value(t.best_validation)),
        f"  Latest checkpoint: {t.latest_checkpoint or ''}",
    ]
    if t.warm_start_checkpoint:
        lines.append(f"  Warm start:        {t.warm_start_checkpoint}")
    if pooled := pool_job(store, t.experiment_id, t.id):
        lines.append(f"  Slurm job:         {pooled[1]} (pool {visible(pooled[0])})")
    lines += [f"  Started:           {fmt_time(t.created_at)}"]
    lines += [f"  Ended:             {fmt_time(t.ended_at)}"]
    if t.message:
        lines += wrap_lines("Message:           ", t.message)
    matched = store.log_policies.matched(trial_id)
    if matched:  # log_policies its output matched (labels; the action, if any)
        shown = ", ".join(f"{n} ({a})" if a else n for n, a in matched)
        lines += wrap_lines("Log policies:      ", shown)
    lines += ["", "Hyperparameters:"]
    hparams = flatten(t.hparams)
    for k, v in hparams:
        lines += wrap_lines(f"{k}: ", fmt_value(v))
    if not hparams:
        lines.append("  (none)")
    for title, rec in (("training", training), ("validation", validation)):
        lines += ["", *_metrics_block(title, rec)]
    lines += ["", "Checkpoints:", checkpoints_table(ckpts)]
    print("\n".join(ln.rstrip() for ln in lines))


def _metrics_block(title: str, rec: MetricRecord | None) -> list[str]:
    if rec is None:
        return [f"Latest {title} metrics: (none yet)"]
    from det_local.tables import wrap_lines

    head = f"Latest {title} metrics (steps {rec.steps_completed}, {fmt_time(rec.time)}):"
    lines = [head]
    for k, v in rec.metrics.items():
        lines += wrap_lines(f"{k}: ", fmt_value(v))
    return lines


# ---------------------------------------------------------------------------- logs
@app.command("logs")
def logs(
    trial_id: Annotated[int, typer.Argument(metavar="TRIAL_ID", help="The trial's id.")],
    follow: Annotated[
        bool,
        typer.Option(
            "--follow", "-f", help="Keep printing new lines until the trial stops or pauses."
        ),
    ] = False,
    rank: Annotated[
        Optional[int], typer.Option("--rank", help="Only the lines of this worker rank.", min=0)
    ] = None,
    tail: Annotated[
        Optional[int], typer.Option("--tail", help="Start with only the last N lines.", min=0)
    ] = None,
) -> None:
    """Print a trial's output: every run and rank (rank N's lines start with [rank=N])."""
    from det_local.cli import hot

    hot.trial_logs(trial_id, follow, rank, tail)


@app.command("kill")
def kill(
    trial_id: Annotated[int, typer.Argument(metavar="TRIAL_ID", help="The trial's id.")],
) -> None:
    """Stop one trial of a search now; it ends CANCELED and the searcher goes on without it
    (as Determined's searchers hear a trial that exited early)."""
    from det_local.api import control_job

    print(control_job("trial_kill", {"trial_id": trial_id}))
