"""The Python API the CLI is a thin layer over. Reads open the store read-only; changes go to
the daemon (or, with none running, to an embedded runner started for the purpose)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from det_local.store.db import Store
from det_local.store.paths import Paths
from det_local.store.states import State

if TYPE_CHECKING:
    from det_local.client.testmode import TestReport


def paths() -> Paths:
    return Paths.from_env()


_SHARED: tuple[Callable[[], Store], Path] | None = None


def use_store(source: Callable[[], Store] | None, home: Paths | None = None) -> None:
    """A long-lived reader (the dashboard: web/pool.py) hands out its own read-only Stores of
    `home`: open_store() of that home returns source()'s, never closed by the caller."""
    global _SHARED
    _SHARED = None if source is None or home is None else (source, home.db)


def open_store(p: Paths | None = None) -> Store:
    """A read-only view of the store (empty when nothing has run yet)."""
    db = (p or paths()).db
    if _SHARED is not None and _SHARED[1] == db:
        return _SHARED[0]()
    return Store(db, readonly=True)


def run(
    config_path: str | Path,
    context_dir: str | Path,
    *,
    follow: bool = True,
    quiet: bool = False,
    test_mode: bool = False,
    anywhere: bool = False,
) -> int:
    """Submit an experiment and, with follow=True, run it to the end; returns the exit code.

    anywhere: as `resources.federate: true` (a trial may run on an idle peer of the cluster).

    test_mode: Determined's test mode (one batch, validate, checkpoint, restore in a new
    process, one more batch); prints the pass/fail report and returns 0 only if all passed."""
    from det_local.client.embedded import run_experiment

    return run_experiment(
        paths(),
        Path(config_path),
        Path(context_dir),
        follow=follow,
        quiet=quiet,
        test_mode=test_mode,
        anywhere=anywhere,
    )


def create_experiment(
    config_path: str | Path,
    context_dir: str | Path,
    *,
    follow: bool,
    test_mode: bool = False,
    anywhere: bool = False,
) -> int:
    """`experiment create`: submit to the running engine and return 0 at once (the id is
    printed), or with follow=True run and follow as `run` does (an embedded engine when none
    runs); returns the exit code."""
    if not follow:
        from det_local.errors import DetLocalError
        from det_local.sched.enginelock import lock_free

        p = paths()
        if lock_free(p):
            raise DetLocalError(
                f"no det-local daemon is running for {p.home}: `det-local daemon start` "
                "first, or `det-local experiment create -f` runs the experiment in this terminal"
            )
    return run(config_path, context_dir, follow=follow, test_mode=test_mode, anywhere=anywhere)


def test_experiment(
    config_path: str | Path, context_dir: str | Path, *, home: str | Path | None = None
) -> TestReport:
    """Run CONFIG in test mode with no output and return the report (what the pytest plugin
    uses). ``home`` defaults to DET_LOCAL_HOME."""
    from det_local.client.embedded import run_experiment
    from det_local.client.testmode import build_report

    p = Paths(Path(home).absolute()) if home is not None else paths()
    box: list[TestReport] = []

    def finish(store: Store, exp_id: int, elapsed: float) -> tuple[str, int]:
        box.append(build_report(store, p, exp_id))
        return "", 0

    run_experiment(
        p, Path(config_path), Path(context_dir), quiet=True, test_mode=True, finish=finish
    )
    return box[0]


def control(experiment_id: int, action: str, **fields: object) -> str:
    """pause | activate | kill | label_add | label_remove an experiment; returns a message."""
    from det_local.client.control import control_experiment

    return control_experiment(paths(), experiment_id, action, **fields)


def control_job(op: str, payload: dict[str, object]) -> Any:
    """A job-queue request (cmd_run, cmd_kill, job_update, job_update_batch)."""
    from det_local.client.control import control_job as send

    return send(paths(), op, payload)


def follow_command(job_id: int, poll: float = 0.05, p: Paths | None = None) -> int:
    """Stream a command's output until it ends; returns its exit status (1 if unknown)."""
    from det_local.client.follow import follow_command as follow

    return follow(p or paths(), job_id, poll)


def trial_logs(
    trial_id: int,
    out: IO[bytes],
    *,
    follow: bool = False,
    rank: int | None = None,
    tail: int | None = None,
) -> None:
    """Write a trial's output to `out`: every run and rank (rank N's lines start with
    `[rank=N] `), or only rank `rank`'s; with `tail`, only the last N of those lines. With
    `follow`, keep writing new lines until the trial is PAUSED or has ended (its state is
    re-read from the store whenever no new output has come), then what is left."""
    from det_local.store.logtail import LogTail
    from det_local.store.logtail import follow as follow_until

    store = open_store()
    trial = store.get_trial(trial_id)
    prefix = None if rank is None else f"[rank={rank}] ".encode()
    path = paths().trial_log(trial.experiment_id, trial_id)
    if trial.state.terminal and not path.exists():
        _logs_removed(store, trial.experiment_id, trial_id)
    log = LogTail(path, prefix=prefix, last=tail)

    def pump() -> bool:
        if log.pump(out.write):
            out.flush()
            return True
        return False

    def done() -> bool:
        state = store.get_trial(trial_id).state
        return state.terminal or state is State.PAUSED

    try:
        if follow:
            follow_until(pump, done, poll=0.02, max_poll=0.1)
        else:
            log.pump(out.write)
    except PermissionError as err:
        from det_local.client.attach import logs_private

        raise logs_private(err, store.get_experiment(trial.experiment_id)) from None
    out.write(log.rest())
    out.flush()


def _logs_removed(store: Store, experiment_id: int, trial_id: int) -> None:
    """An ended trial without its log: say so when its retention policy removed it."""
    import time

    exp = store.get_experiment(experiment_id)
    days = (exp.config.get("retention_policy") or {}).get("log_retention_days")
    if (
        isinstance(days, int)
        and days >= 0
        and exp.ended_at is not None
        and exp.ended_at + days * 86400 <= time.time()
    ):
        from det_local.errors import NotFoundError

        raise NotFoundError(
            f"trial {trial_id}'s logs were removed: experiment {experiment_id} ended more than "
            f"{days} day{'s' if days != 1 else ''} ago (retention_policy.log_retention_days); "
            "its metrics and checkpoints remain"
        )


def command_exit_status(job: Any) -> int:
    """The exit status for an ended command's job, as a shell reports it."""
    from det_local.client.follow import command_exit_status as status

    return status(job)


def ranked_trials(store: Store, experiment_id: int) -> list[Any]:
    """The experiment's trials, best searcher metric first (trials without one last; NaN and
    the infinities, which the daemon never records as a best, rank after every number)."""
    from det_local.client.searchsummary import rank, searcher_of

    _, smaller = searcher_of(store.get_experiment(experiment_id).config)
    return rank(store.list_trials(experiment_id), smaller)


def trial_rungs(store: Store, experiment_id: int) -> dict[int, int]:
    """trial id -> the ASHA rung it reached (empty for searchers without rungs)."""
    from det_local.config import parse_config
    from det_local.search import make_searcher

    exp = store.get_experiment(experiment_id)
    snap = store.get_searcher_state(experiment_id)
    if not snap:
        return {}
    try:
        searcher = make_searcher(parse_config(exp.config, source=f"experiment {experiment_id}"))
        searcher.restore(snap["searcher"])
    except Exception:  # a searcher this version cannot rebuild: no rung column
        return {}
    out = {}
    for rid, trial_id in (snap.get("trial_of") or {}).items():
        rung = searcher.rung_of(rid)
        if rung is not None:
            out[int(trial_id)] = int(rung)
    return out


def best_trial(experiment_id: int) -> dict[str, Any]:
    """The best trial by the searcher metric, and its best checkpoint (the one recorded at its
    best validation's steps, else its latest)."""
    from det_local.errors import NotFoundError

    store = open_store()
    ranked = [t for t in ranked_trials(store, experiment_id) if t.best_validation is not None]
    if not ranked:
        raise NotFoundError(
            f"experiment {experiment_id} has no trial with a validation of its searcher metric yet"
        )
    trial = ranked[0]
    from det_local.client.searchsummary import best_checkpoint, searcher_of

    metric, _ = searcher_of(store.get_experiment(experiment_id).config)
    ckpt = best_checkpoint(store, trial, metric)
    return {
        "experiment_id": experiment_id,
        "metric": metric,
        "trial": trial.to_json(),
        "best_validation": trial.best_validation,
        "checkpoint": ckpt.to_json() if ckpt else None,
    }


def trial_metrics(trial_id: int, group: str | None = None) -> list[Any]:
    """Every metric report of the trial (of `group` only, when given), in the order they were
    recorded: MetricRecords (trial_id, run_id, group, steps_completed, time, metrics). A group
    the trial has no report in is an error naming the groups it has."""
    import difflib

    from det_local.errors import NotFoundError

    store = open_store()
    store.get_trial(trial_id)  # a clear error for an unknown id
    if group == "system" and store.usage.has_samples(trial_id):  # the daemon's samples
        return system_metrics(trial_id)
    reports = store.list_metrics(trial_id, group)
    if group is not None and not reports:
        groups = store.metric_groups(trial_id)
        if store.usage.has_samples(trial_id):
            groups = sorted([*groups, "system"])
        if not groups:
            raise NotFoundError(f"trial {trial_id} has reported no metrics yet")
        close = difflib.get_close_matches(group, groups, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise NotFoundError(
            f"trial {trial_id} has no '{group}' metrics; {hint}it has reported "
            + ", ".join(groups)
            + " metrics (--group NAME)"
        )
    return reports


def experiment_events(experiment_id: int) -> list[dict[str, Any]]:
    """What happened to the experiment, oldest first: pauses, preemptions, restarts, checkpoint
    GC, failures; each {time, level, trial_id, message}."""
    store = open_store()
    store.get_experiment(experiment_id)  # a clear error for an unknown id
    return [
        {"time": t, "level": level, "trial_id": trial_id, "message": message}
        for t, level, trial_id, message in store.list_events(experiment_id)
    ]


# ---------------------------------------------------------------------------- what --json prints
# One builder per `--json` output, shared by the CLI and the dashboard's /api/ (same keys).
TRAINING = "training"
VALIDATION = "validation"
MAX_POINTS = 2000  # per series, what the dashboard's charts get (downsampled in the store)


def list_experiments(
    *, all_users: bool = True, with_config: bool = False, archived: bool = True
) -> list[Any]:
    """Experiments oldest first (ExperimentRecords), every user's or only this user's;
    archived ones too unless ``archived`` is False (`experiment archive`)."""
    from det_local.store.db import current_user

    store = open_store()
    exps = store.list_experiments(with_config=with_config)
    if not all_users:
        user = current_user()
        exps = [e for e in exps if e.user == user]
    if not archived:
        hidden = store.lifecycle.archived()
        exps = [e for e in exps if e.id not in hidden]
    return exps


def experiments_json(*, all_users: bool = True, archived: bool = True) -> list[dict[str, Any]]:
    """`experiment list --json` (each with "archived")."""
    store = open_store()
    hidden = store.lifecycle.archived()
    exps = list_experiments(all_users=all_users, with_config=True, archived=archived)
    return [{**e.to_json(), "archived": e.id in hidden} for e in exps]


def experiment_json(experiment_id: int) -> dict[str, Any]:
    """`experiment describe --json`: the experiment, its trials best first (with the ASHA rung
    each reached, None for other searchers) and its checkpoints."""
    store = open_store()
    exp = store.get_experiment(experiment_id)
    trials = ranked_trials(store, experiment_id)
    rungs = trial_rungs(store, experiment_id)
    ckpts = store.list_checkpoints(experiment_id=experiment_id)
    return {
        "experiment": exp.to_json(),
        "trials": [{**t.to_json(), "rung": rungs.get(t.id)} for t in trials],
        "checkpoints": [c.to_json() for c in ckpts],
    }


def hparams_json(experiment_id: int) -> dict[str, Any]:
    """The experiment's hyperparameter view (the dashboard's /hparams page): {"experiment_id",
    "name", "state", "metric", "smaller_is_better", "hyperparameters": [{"name" (nested ones
    dotted), "type", the config's range or values (minval/maxval/base/count, vals, val),
    "varies" (more than one value among the trials)}], "trials": [{"trial_id", "state",
    "hparams" (flat), "metric", "rung"}]}. A trial's metric is its best validation value of the
    searcher metric (what the experiment page's Best column and the ranking use; None before
    its first validation); trials best first. A hyperparameter the config does not define (a
    const dict's keys) has the type of its values: double when all are numbers, else
    categorical."""
    from det_local.client.searchsummary import searcher_of
    from det_local.tables import flatten

    store = open_store()
    exp = store.get_experiment(experiment_id)
    metric, smaller = searcher_of(exp.config)
    trials = ranked_trials(store, experiment_id)
    rungs = trial_rungs(store, experiment_id)
    flat = [dict(flatten(t.hparams)) for t in trials]
    defined = _hparam_definitions(exp.config, source=f"experiment {experiment_id}")
    seen = {name: None for hp in flat for name in hp}
    names = [n for n in defined if n in seen or not trials] + [n for n in seen if n not in defined]
    hyperparameters = []
    for name in names:
        values = [hp[name] for hp in flat if name in hp]
        kind = defined.get(name) or {"type": _value_type(values)}
        distinct = {json.dumps(v, sort_keys=True, default=str) for v in values}
        hyperparameters.append({"name": name, **kind, "varies": len(distinct) > 1})
    return {
        "experiment_id": experiment_id,
        "name": exp.name,
        "state": exp.state.value,
        "metric": metric,
        "smaller_is_better": smaller,
        "hyperparameters": hyperparameters,
        "trials": [
            {
                "trial_id": t.id,
                "state": t.state.value,
                "hparams": hp,
                "metric": t.best_validation,
                "rung": rungs.get(t.id),
            }
            for t, hp in zip(trials, flat, strict=True)
        ],
    }


def _hparam_definitions(config: dict[str, Any], source: str) -> dict[str, dict[str, Any]]:
    """Flat name -> the definition's dict ({"type": "log", "minval": ...}) from a stored config;
    empty when it cannot be read (a config an older version wrote)."""
    from det_local.config.check import Ctx
    from det_local.config.hparams import flat_hparams, parse_hyperparameters
    from det_local.errors import DetLocalError

    try:
        hps = parse_hyperparameters(Ctx(source), config.get("hyperparameters"))
    except DetLocalError:
        return {}
    return {name: hp.to_dict() for name, hp in flat_hparams(hps)}


def _value_type(values: list[Any]) -> str:
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    return "double" if values and numbers else "categorical"


def trial_json(trial_id: int) -> dict[str, Any]:
    """`trial describe --json`: the trial, its checkpoints, its latest training and
    validation metrics."""
    store = open_store()
    t = store.get_trial(trial_id)
    training = store.latest_metrics(trial_id, TRAINING)
    validation = store.latest_metrics(trial_id, VALIDATION)
    return {
        "trial": t.to_json(),
        # Determined 0.38's log_policies its output matched: [{name, action}]
        "log_policies": [
            {"name": n, "action": a or None} for n, a in store.log_policies.matched(trial_id)
        ],
        "checkpoints": [c.to_json() for c in store.list_checkpoints(trial_id=trial_id)],
        "metrics": {
            TRAINING: training.to_json() if training else None,
            VALIDATION: validation.to_json() if validation else None,
        },
    }


def trial_metrics_sampled(
    trial_id: int, group: str | None = None, max_points: int = MAX_POINTS
) -> list[Any]:
    """As trial_metrics (every group, or `group`), but at most ~max_points reports per group,
    spread evenly over steps_completed (the latest always among them): what a chart draws."""
    store = open_store()
    store.get_trial(trial_id)  # a clear error for an unknown id
    out: list[Any] = []
    for g in [group] if group is not None else store.metric_groups(trial_id):
        out += store.sample_metrics(trial_id, g, max_points)
    if group is not None and not out:
        trial_metrics(trial_id, group)  # none: its error names the groups the trial has
    return out


def queue(*, include_done: bool = False, limit: int | None = None) -> list[Any]:
    """The jobs in the order the scheduler goes by (JobRecords; `job list`'s # is the place)."""
    from det_local.client.queueview import in_queue_order

    jobs = in_queue_order(open_store().jobs.list(include_done=include_done), paths())
    return jobs if limit is None else jobs[: max(limit, 0)]


def jobs_json(*, include_done: bool = False, limit: int | None = None) -> list[dict[str, Any]]:
    """`job list --json`: each job with its place in the queue ("position", from 1)."""
    jobs = queue(include_done=include_done, limit=limit)
    where = job_pools(jobs)
    return [
        {**j.to_json(), "position": i + 1, "pool": where[j.id], "ran_on": ran_on(j)}
        for i, j in enumerate(jobs)
    ]


def job_pools(jobs: list[Any]) -> dict[int, str]:
    """Each job's resource pool (its experiment's `resources.resource_pool`; `default`: this
    machine's slots)."""
    from det_local.errors import DetLocalError
    from det_local.pools import DEFAULT, is_default

    store = open_store()
    by_exp: dict[int, str] = {}
    out: dict[int, str] = {}
    for j in jobs:
        exp_id = j.experiment_id
        if exp_id is not None and exp_id not in by_exp:
            try:
                name = (store.get_experiment(exp_id).config.get("resources") or {}).get(
                    "resource_pool"
                )
            except DetLocalError:
                name = None
            by_exp[exp_id] = DEFAULT if is_default(name) else str(name)
        if exp_id is not None:
            out[j.id] = by_exp.get(exp_id, DEFAULT)
        else:  # a command: `cmd run --pool`
            row = store.job_pools.get(j.id)
            out[j.id] = DEFAULT if row is None else row[0]
    return out


def pools_rows() -> list[dict[str, str]]:
    """`slots`: the resource pools this home's daemon.yaml defines (the default one first)."""
    from det_local.pools import load_pools

    return load_pools(paths().settings).describe()


def slots_json() -> list[dict[str, Any]]:
    """`slots --json`: this machine's slots as the running engine sees them (discovered here
    when none runs), with who uses each."""
    from det_local.client.slotview import current

    return mark_disabled(current(paths()).rows())


def mark_disabled(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each slot row with `disabled` (`slot disable`: drained, kept across restarts); a
    disabled slot's "used by" says so."""
    disabled = open_store().drains.slots()
    for r in rows:
        r["disabled"] = r["index"] in disabled
        if r["disabled"]:
            r["used_by"] = f"{r['used_by']} (disabled)".strip()
    return rows


def trial_log_chunk(
    trial_id: int, *, offset: int | None = None, tail: int | None = None, limit: int = 1 << 20
) -> dict[str, Any]:
    """A trial's output from byte `offset` (or its last `tail` lines), whole lines only, at
    most about `limit` bytes: {"trial_id", "offset" (where the next chunk starts), "lines",
    "state"}. What a web view polls or streams; `trial logs` follows the same files."""
    from det_local.store.logtail import LogTail

    store = open_store()
    trial = store.get_trial(trial_id)
    path = paths().trial_log(trial.experiment_id, trial_id)
    log = LogTail(path, start=offset or 0, last=tail if offset is None else None)
    chunks: list[bytes] = []
    size = 0

    def keep(data: bytes) -> None:
        nonlocal size
        chunks.append(data)
        size += len(data)

    try:
        if offset is not None and offset > _size(path):  # truncated, or a wrong offset
            log = LogTail(path)
        log.pump(keep)
    except PermissionError as err:
        from det_local.client.attach import logs_private

        raise logs_private(err, store.get_experiment(trial.experiment_id)) from None
    data = b"".join(chunks)
    end = log.resume_offset
    if len(data) > limit:  # the rest comes with the next chunk
        cut = data.rfind(b"\n", 0, limit) + 1 or len(data)
        end -= len(data) - cut
        data = data[:cut]
    text = data.decode("utf-8", errors="replace")
    return {
        "trial_id": trial_id,
        "offset": end,
        "lines": text.splitlines(),
        "state": trial.state.value,
    }


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def trial_progress(trial_id: int, after: int | None = None) -> tuple[str, int]:
    """(the trial's state, the row id of its newest metric report if newer than `after`, else
    `after`): cheap to ask often, what a live view compares to know that something changed.
    after=None starts from the newest report of any trial (what a view already shows)."""
    store = open_store()
    state = store.get_trial(trial_id).state.value
    if after is None:
        return state, store.newest_metric_id()
    return state, store.last_metric_id(trial_id, after)


def experiment_summaries() -> dict[int, dict[str, Any]]:
    """experiment id -> {"searcher", "metric", "smaller_is_better", "best" (the best trial's
    searcher metric, None before any validation), "trials" (counts by state)}: what a list of
    experiments shows beside each one, in two queries for all of them."""
    store = open_store()
    searchers = store.experiment_searchers()
    trials = store.trial_summaries()
    out: dict[int, dict[str, Any]] = {}
    for exp_id, (name, metric, smaller) in searchers.items():
        s = trials.get(exp_id)
        best = None
        if s is not None:
            best = s.lowest if smaller else s.highest
        out[exp_id] = {
            "searcher": name,
            "metric": metric,
            "smaller_is_better": smaller,
            "best": best,
            "trials": dict(s.counts) if s else {},
        }
    return out


# ---------------------------------------------------------------------------- learning curves
def _int_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _config_batch_size(config: dict[str, Any]) -> int | None:
    """hyperparameters.global_batch_size of a stored config when it is a constant integer."""
    hp = (config.get("hyperparameters") or {}).get("global_batch_size")
    if isinstance(hp, dict) and hp.get("type") == "const":
        hp = hp.get("val")
    return _int_or_none(hp)


def experiment_curves(
    experiment_id: int, group: str = VALIDATION, max_points: int = MAX_POINTS
) -> dict[str, Any]:
    """The experiment's learning curves of `group`, with what a chart needs to draw them in
    records, epochs or time and to pick its best trials: {"experiment_id", "group", "state",
    "metric", "smaller_is_better", "records_per_epoch" (None when the config has none),
    "trials": [{"trial_id", "state", "started_at" (the trial's created_at: what a report's
    "time" is counted from), "global_batch_size" (the trial's hyperparameter, else the
    config's constant, else None), "best_validation", "reports"}]}, trials best first
    (searcher metric, smaller_is_better respected), reports downsampled as
    trial_metrics_sampled."""
    from det_local.client.searchsummary import rank, searcher_of

    store = open_store()
    exp = store.get_experiment(experiment_id)
    metric, smaller = searcher_of(exp.config)
    batch_size = _config_batch_size(exp.config)
    trials = rank(store.list_trials(experiment_id), smaller)
    return {
        "experiment_id": experiment_id,
        "group": group,
        "state": exp.state.value,
        "metric": metric,
        "smaller_is_better": smaller,
        "records_per_epoch": _int_or_none(exp.config.get("records_per_epoch")),
        "trials": [
            {
                "trial_id": t.id,
                "state": t.state.value,
                "started_at": t.created_at,
                "global_batch_size": _int_or_none(t.hparams.get("global_batch_size")) or batch_size,
                "best_validation": t.best_validation,
                "reports": [r.to_json() for r in store.sample_metrics(t.id, group, max_points)],
            }
            for t in trials
        ],
    }


def experiment_progress(experiment_id: int, after: int | None = None) -> tuple[str, int]:
    """(the experiment's state, the row id of its trials' newest metric report if newer than
    `after`, else `after`): what a live experiment view asks every few seconds before it
    fetches the curves again. after=None starts from the newest report of any trial."""
    store = open_store()
    state = store.get_experiment(experiment_id).state.value
    if after is None:
        return state, store.newest_metric_id()
    return state, store.last_experiment_metric_id(experiment_id, after)


def open_trial_log(trial_id: int) -> tuple[str, IO[bytes] | None]:
    """(a file name for it, the trial's whole output opened for reading, None before it
    wrote any): what a raw log download streams. Unreadable logs are LogsPrivate (one line)."""
    store = open_store()
    trial = store.get_trial(trial_id)
    path = paths().trial_log(trial.experiment_id, trial_id)
    name = f"experiment-{trial.experiment_id}-trial-{trial_id}.log"
    try:
        return name, open(path, "rb")  # noqa: SIM115 (the caller streams and closes it)
    except FileNotFoundError:
        return name, None
    except PermissionError as err:
        from det_local.client.attach import logs_private

        raise logs_private(err, store.get_experiment(trial.experiment_id)) from None


MAX_COMPARE = 10  # experiments one comparison shows


def compare_json(experiment_ids: list[int]) -> list[dict[str, Any]]:
    """Experiments side by side (at most MAX_COMPARE, each known): each {"id", "name",
    "state", "user", "searcher", "metric", "smaller_is_better", "best", "trials" (counts by
    state), "hyperparameters" (the space: dotted name -> its definition)}."""
    from det_local.errors import DetLocalError

    if not experiment_ids:
        raise DetLocalError("nothing to compare: give experiment ids, e.g. /compare?ids=1,2")
    if len(experiment_ids) > MAX_COMPARE:
        raise DetLocalError(
            f"{len(experiment_ids)} experiments: at most {MAX_COMPARE} can be compared at once"
        )
    store = open_store()
    exps = [store.get_experiment(i) for i in experiment_ids]  # NotFoundError for an unknown id
    summaries = experiment_summaries()
    out = []
    for e in exps:
        s = summaries.get(e.id, {})
        space = e.config.get("hyperparameters") or {}
        out.append(
            {
                "id": e.id,
                "name": e.name,
                "state": e.state.value,
                "user": e.user,
                "searcher": s.get("searcher"),
                "metric": s.get("metric"),
                "smaller_is_better": s.get("smaller_is_better"),
                "best": s.get("best"),
                "trials": s.get("trials") or {},
                "hyperparameters": dict(_space(space)),
            }
        )
    return out


def _space(space: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """A stored hyperparameter space as (dotted name, definition) pairs: a definition is a
    dict with "type"; anything else nests (Determined's nested hyperparameters)."""
    out: list[tuple[str, Any]] = []
    for k, v in space.items():
        if isinstance(v, dict) and v and "type" not in v:
            out += _space(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def commands_json(*, include_done: bool = False) -> list[dict[str, Any]]:
    """`cmd list --json`: commands, shells, notebooks and TensorBoards (every job but trials),
    oldest first, each with "link" (the address a notebook or TensorBoard serves on while it
    runs, without its token: that is printed only to its owner, by `notebook start`) and its
    argv with secret-looking option values hidden (client/taskview.py)."""
    from det_local.client.taskview import address, hide_secrets

    out = []
    for j in open_store().jobs.list(include_done=include_done):
        if j.kind == "TRIAL":
            continue
        d = j.to_json()
        d["argv"] = hide_secrets(j.argv)
        d["link"] = address(j.kind, j.argv) if j.state == "SCHEDULED" else None
        d["ran_on"] = ran_on(j)
        out.append(d)
    return out


def ended_commands() -> int:
    """How many commands (every job but trials) have ended: what `cmd list` leaves out
    without --all."""
    jobs = open_store().jobs
    return sum(1 for j in jobs.list(include_done=True) if j.kind != "TRIAL") - sum(
        1 for j in jobs.list() if j.kind != "TRIAL"
    )


def ran_on(job: Any) -> str | None:
    """The peer a job was sent to whole (`--anywhere`, `resources.federate`): its output and
    exit status are what that machine reported. None for a job run here."""
    peer = (job.gang or {}).get("anywhere") if isinstance(job.gang, dict) else None
    return str(peer) if peer else None


def cluster_view() -> dict[str, Any]:
    """The running daemon's view of its cluster: {"federation": "on"|"off", "why" (when off),
    "node", "port", "cluster", "mdns", "live_peers" (when on), "peers": peers_rows}. A one-line
    NoDaemon error when no daemon runs (the cluster exists only in a daemon)."""
    from det_local.federate.client import request

    view = dict(request(paths(), {"t": "peers"}) or {})
    view["peers"] = peer_rows(view)
    return view


def peer_rows(view: dict[str, Any]) -> list[dict[str, Any]]:
    """Each node of the view (this one first, "state": "self"; then alive, suspect, dead or
    left peers) with "jobs": this node's running jobs whose processes are there ({"id",
    "kind", "name", "user", "slots"}; a share of a peer's gang shows on this node)."""
    from det_local.sched.extensions import runs_on

    rows = [dict(r) for r in view.get("peers") or []]
    if not rows:
        return rows
    me = str(view.get("node") or "local")
    where: dict[str, list[dict[str, Any]]] = {}
    for j in open_store().jobs.list(include_done=False):
        for node in filter(None, runs_on(j, me).split(",")):
            where.setdefault(node, []).append(
                {"id": j.id, "kind": j.kind, "name": j.name, "user": j.user, "slots": j.slots}
            )
    for r in rows:
        r["jobs"] = where.get(str(r["id"]), [])
    return rows


def peers_json() -> list[dict[str, Any]]:
    """`cluster peers --json`: every node of the cluster, this one included ([] when this
    daemon does not federate)."""
    rows: list[dict[str, Any]] = cluster_view()["peers"]
    return rows


# ---------------------------------------------------------------------- usage (issue 30)
def system_metrics(trial_id: int | None = None, job_id: int | None = None) -> list[Any]:
    """A trial's (or a command's, notebook's, shell's: job_id) system metrics as MetricRecords
    of group "system", oldest first (`det_local/usage/readers.py`)."""
    from det_local.usage.readers import command_metrics
    from det_local.usage.readers import system_metrics as read

    store = open_store()
    if job_id is not None:
        return command_metrics(store, job_id)
    assert trial_id is not None
    store.get_trial(trial_id)
    return read(store, trial_id=trial_id)


def usage(since: float, by: str = "user", until: float | None = None) -> dict[str, Any]:
    """`det-local usage --json`: slot-hours allocated and used (`det_local/usage/report.py`)."""
    from det_local.usage.readers import usage as read

    return read(open_store(), since=since, by=by, until=until)


def idle_notes(job_ids: list[int] | None = None) -> dict[int, str]:
    """Jobs flagged for holding idle slots: job id -> one line for their owner."""
    from det_local.usage.readers import idle_notes as read

    return read(open_store(), job_ids)


# ---------------------------------------------------------------------------- the model registry
def models_json() -> list[dict[str, Any]]:
    """`model list --json` and the dashboard's /api/models: every model, by name."""
    return [m.to_json() for m in open_store().models.select()]


def model_json(identifier: str | int) -> dict[str, Any]:
    """/api/models/NAME: the model and its versions, each with the checkpoint it points at
    (None when that record is gone; "experiment_deleted" when its experiment was deleted)."""
    from det_local.errors import NotFoundError

    store = open_store()
    model = store.models.get(identifier)
    versions = []
    for v in store.models.versions(model.id):
        try:
            ckpt: dict[str, Any] | None = store.get_checkpoint(v.checkpoint_uuid).to_json()
        except NotFoundError:
            ckpt = None
        if ckpt is not None:  # its experiment may have been deleted (the checkpoint stays)
            try:
                store.get_experiment(int(ckpt["experiment_id"]))
                ckpt["experiment_deleted"] = False
            except NotFoundError:
                ckpt["experiment_deleted"] = True
        versions.append({**v.to_json(), "checkpoint": ckpt})
    return {"model": model.to_json(), "versions": versions}
