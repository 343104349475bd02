"""What a run did, after the fact: `trial metrics` (every report), `experiment events`, and the
best-trial line that ends `experiment describe`. Registered on the trial and experiment groups
(`cli/trial.py`, `cli/experiment.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from det_local.cli.results.checkpoint import JsonFlag, fmt_time, fmt_value

if TYPE_CHECKING:
    from det_local.store.records import MetricRecord

CsvFlag = Annotated[
    bool, typer.Option("--csv", help="Print CSV (a header, then one row per report).")
]
GroupOption = Annotated[
    Optional[str],
    typer.Option(
        "--group",
        "-g",
        metavar="training|validation|NAME",
        help="Only the reports of this group (default: every group).",
    ),
]
FIXED = ["trial_id", "run_id", "group", "steps_completed", "time"]


# ---------------------------------------------------------------------------- trial metrics
def trial_metrics(
    trial_id: Annotated[int, typer.Argument(metavar="TRIAL_ID", help="The trial's id.")],
    group: GroupOption = None,
    as_json: JsonFlag = False,
    as_csv: CsvFlag = False,
) -> None:
    """Every metric report of a trial: steps completed, time and values, oldest first."""
    from det_local.errors import DetLocalError
    from det_local.views import experiments as expviews

    if as_json and as_csv:
        raise DetLocalError("--json and --csv: choose one")
    reports = expviews.trial_metrics(trial_id, group)
    if as_json:
        from det_local.cli.common import print_json

        print_json([r.to_json() for r in reports])
    elif as_csv:
        write_csv(reports)
    elif not reports:
        print(f"trial {trial_id} has reported no metrics yet")
    else:
        print(metrics_table(reports, with_group=group is None))


def metric_names(reports: list[MetricRecord]) -> list[str]:
    """Every metric name in the reports, in the order they first appear."""
    names: dict[str, None] = {}
    for r in reports:
        names.update(dict.fromkeys(r.metrics))
    return list(names)


def metrics_table(reports: list[MetricRecord], *, with_group: bool) -> str:
    """One row per report, one column per metric name (a Run column once a restart made more
    than one run)."""
    from det_local.cli.common import table

    names = metric_names(reports)
    runs = len({r.run_id for r in reports}) > 1
    headers = (["Group"] if with_group else []) + (["Run"] if runs else [])
    headers += ["Steps", "Time", *names]
    rows = []
    for r in reports:
        row: list[Any] = [r.group] if with_group else []
        row += [r.run_id] if runs else []
        row += [r.steps_completed, fmt_time(r.time)]
        row += [fmt_value(r.metrics[n]) if n in r.metrics else "" for n in names]
        rows.append(row)
    return table(headers, rows)


def write_csv(reports: list[MetricRecord]) -> None:
    """trial_id, run_id, group, steps_completed, time (Unix seconds, as --json has it), then
    one column per metric name; a value a report lacks is empty, a list or dict is JSON."""
    import csv
    import json
    import sys

    names = metric_names(reports)
    out = csv.writer(sys.stdout, lineterminator="\n")
    out.writerow(FIXED + names)
    for r in reports:
        values = []
        for n in names:
            v = r.metrics.get(n)
            values.append(json.dumps(v) if isinstance(v, dict | list) else "" if v is None else v)
        out.writerow([r.trial_id, r.run_id, r.group, r.steps_completed, f"{r.time:.3f}", *values])


# ---------------------------------------------------------------------------- experiment events
def experiment_events(
    experiment_id: Annotated[
        int, typer.Argument(metavar="EXPERIMENT_ID", help="The experiment's id.")
    ],
    as_json: JsonFlag = False,
) -> None:
    """What happened to an experiment: pauses, preemptions, restarts, failures, checkpoint GC."""
    from det_local.cli.common import print_json
    from det_local.tables import table
    from det_local.views import experiments as expviews

    events = expviews.experiment_events(experiment_id)
    if as_json:
        print_json(events)
        return
    rows = [
        [
            fmt_time(e["time"]),
            e["level"],
            "" if e["trial_id"] is None else e["trial_id"],
            e["message"],
        ]
        for e in events
    ]
    # the message whole in a pipe (grep, a bug report): the table is cut at the terminal only
    print(table(["Time", "Level", "Trial", "Message"], rows, whole="Message"))


# ---------------------------------------------------------------------------- best trial
def best_lines(experiment_id: int) -> list[str]:
    """The end of `experiment describe`: the best trial by the searcher's metric and its
    checkpoint, or why there is none yet."""
    from det_local.errors import NotFoundError
    from det_local.views import experiments as expviews

    try:
        best = expviews.best_trial(experiment_id)
    except NotFoundError:
        return ["Best trial: none yet (no trial has validated the searcher's metric)"]
    t = best["trial"]
    ckpt = best["checkpoint"]
    where = (
        f"checkpoint {ckpt['uuid']} (steps_completed={ckpt['steps_completed']})"
        if ckpt
        else "no checkpoint"
    )
    from det_local.tables import wrap_lines

    value = f"{t['id']}, {best['metric']} {fmt_value(best['best_validation'])}, {where}"
    return wrap_lines("Best trial: ", value, indent=0)
