"""Read models of experiments, trials and models: what `experiment list|describe`, `trial
describe`, the dashboard's experiment pages and `--json` output show (the store, read-only)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from det_local.store.db import Store

if TYPE_CHECKING:
    pass
from det_local.api import open_store


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
        from det_local.views.cluster import system_metrics

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


def experiment_rows(*, all_users: bool, archived: bool) -> tuple[list[Any], set[int], int]:
    """What `experiment list` shows, from one read: the experiments (as list_experiments), the
    ids of the archived ones among them (marked), and how many of other users' it leaves out
    (0 with ``all_users``; archived ones counted only when ``archived``)."""
    from det_local.store.db import current_user

    store = open_store()
    hidden = store.lifecycle.archived()
    exps = store.list_experiments()
    if not archived:
        exps = [e for e in exps if e.id not in hidden]
    if all_users:
        return exps, hidden, 0
    user = current_user()
    mine = [e for e in exps if e.user == user]
    return mine, hidden, len(exps) - len(mine)


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
    from det_local.pools import pool_job

    pooled = pool_job(store, t.experiment_id, trial_id)
    return {
        "trial": t.to_json(),
        # a run in a Slurm pool: that pool and the Slurm job of its latest run
        "slurm_job": None if pooled is None else {"pool": pooled[0], "id": pooled[1]},
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
