"""`experiment continue ID [--config KEY=VALUE...]` (Determined's `det experiment
continue`): more training for an ended single-trial experiment, from its trial's latest
checkpoint, with the config changed where the overrides say (e.g. `searcher.max_length`).

The same experiment and trial go on: the experiment and trial become ACTIVE again (their
earlier message and restarts cleared), a fresh `single` searcher from the new config gives the
trial its operation, and the trial is queued; it resumes from its latest checkpoint with its
steps_completed, as after a pause. Refused while the experiment runs, for searches (more than
one trial, or a searcher other than single) and for unmanaged (core_v2) experiments."""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from det_local.config.overrides import merge
from det_local.errors import ConfigError, StateError
from det_local.sched.life.ckpt_gc import CheckpointGC
from det_local.sched.life.experiments import ExperimentRun, checkpoint_dir_for
from det_local.sched.life.trialjobs import TrialJobs
from det_local.search.actions import Action, Create
from det_local.store import continuation
from det_local.store.db import Store
from det_local.store.paths import Paths
from det_local.store.states import State


class Continuing(Protocol):
    store: Store
    paths: Paths
    experiments: dict[int, ExperimentRun]
    gc: CheckpointGC
    trial_jobs: TrialJobs

    def apply(self, exp: ExperimentRun, actions: list[Action]) -> None: ...

    def save_searcher(self, exp: ExperimentRun) -> None: ...

    def check_idle(self) -> None: ...


def continue_experiment(engine: Continuing, experiment_id: int, overrides: Any) -> str:
    from det_local.config import parse_config
    from det_local.sched.sessions import unmanaged
    from det_local.search import make_searcher

    rec = engine.store.get_experiment(experiment_id)
    if unmanaged.is_unmanaged(rec.config):
        raise StateError(
            f"experiment {experiment_id} is unmanaged (core_v2): det-local did not start its "
            "trial, so it cannot continue it; run your script again"
        )
    if not rec.state.terminal:
        raise StateError(
            f"experiment {experiment_id} is {rec.state.value}; only an ended experiment "
            "(COMPLETED, CANCELED, ERROR) can be continued (a PAUSED one: `det-local "
            f"experiment activate {experiment_id}`)"
        )
    if experiment_id in engine.gc.running:
        raise StateError(
            f"experiment {experiment_id}'s checkpoint GC is still removing checkpoints; "
            "continue it once that is done (`det-local experiment events` says when)"
        )
    trials = engine.store.list_trials(experiment_id)
    searcher_name = (rec.config.get("searcher") or {}).get("name")
    if len(trials) != 1 or searcher_name != "single":
        raise StateError(
            f"experiment {experiment_id} is a search ({searcher_name}, {len(trials)} trials); "
            "only a single-trial experiment (searcher: single) can be continued"
        )
    if not isinstance(overrides, dict):
        raise ConfigError("config overrides must be a mapping, e.g. searcher.max_length=2000")
    config = merge(rec.config, overrides)
    cfg = parse_config(config, source=f"experiment {experiment_id}'s continued config")
    config = cfg.to_dict()
    (trial,) = trials
    searcher = make_searcher(cfg)
    exp = ExperimentRun(experiment_id, cfg, searcher, checkpoint_dir_for(engine.paths, config))
    # one request, one transaction (the spool's savepoint around its handler)
    continuation.reopen(engine.store.db, experiment_id, config)
    engine.store.set_experiment_state(experiment_id, State.ACTIVE)
    engine.store.set_trial_state(trial.id, State.ACTIVE)
    engine.experiments[experiment_id] = exp
    rest: list[Action] = []
    for action in searcher.initial_actions():
        if isinstance(action, Create):  # the trial it creates is the one that goes on
            exp.trial_of[action.request_id] = trial.id
            exp.request_of[trial.id] = action.request_id
            exp.ops.setdefault(action.request_id, deque())
        else:
            rest.append(action)
    engine.apply(exp, rest)
    engine.save_searcher(exp)
    engine.trial_jobs.enqueue_trial(exp, trial.id)
    engine.check_idle()
    at = f" from checkpoint {trial.latest_checkpoint}" if trial.latest_checkpoint else ""
    return (
        f"experiment {experiment_id} continues: trial {trial.id} resumes at "
        f"steps_completed={trial.steps_completed}{at}"
    )
