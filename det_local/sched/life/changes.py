"""Changing an experiment: pause, activate, kill, labels; and ending one whose searcher
cannot go on. Each is called by its request handler (`sched/intake/handlers.py`) or the engine.
"""

from __future__ import annotations

from typing import Protocol

from det_local.errors import NotFoundError, StateError
from det_local.sched.life.experiments import ExperimentRun, TrialRun, set_stopping
from det_local.sched.life.trialjobs import TrialJobs
from det_local.sched.queue.jobqueue import JobQueue
from det_local.sched.sessions import unmanaged
from det_local.store.states import State, Stopping


class ChangesHost(unmanaged.UnmanagedHost, Protocol):
    """What changing an experiment needs of the engine."""

    queue: JobQueue
    runs: dict[int, TrialRun]
    trial_jobs: TrialJobs  # preempting, terminating, requeueing trials

    def maybe_finish(self, exp: ExperimentRun) -> None: ...

    @property
    def supervisor(self) -> _Queued: ...


class _Queued(Protocol):
    def queued(self, job_id: int) -> str | None: ...


def cancel_if_queued(engine: ChangesHost, run: TrialRun) -> bool:
    """A run still waiting in its pool's queue (a Slurm job PENDING, or its sbatch being tried
    again) has no process to ask for a checkpoint: it is cancelled now, not after
    preemption_timeout. False when it runs (or may: a trial connected)."""
    where = None if run.writers else engine.supervisor.queued(run.job_id)
    if where is None:
        return False
    engine.note(
        f"trial {run.trial_id}: {where} has not started yet: cancelled now (nothing to checkpoint)",
        experiment_id=run.experiment_id,
        trial_id=run.trial_id,
    )
    engine.trial_jobs.terminate(run)
    return True


def pause(engine: ChangesHost, experiment_id: int) -> str:
    unmanaged.refuse_control(engine, experiment_id, "pause")
    exp = engine.experiment(experiment_id)
    state = engine.store.get_experiment(experiment_id).state
    if state in (State.PAUSED, State.STOPPING_PAUSED):
        return f"experiment {experiment_id} is already paused"
    if state != State.ACTIVE:
        raise StateError(
            f"experiment {experiment_id} is {state.value}; only ACTIVE experiments can be paused"
        )
    runs = [r for r in engine.runs.values() if r.experiment_id == experiment_id]
    # STOPPING_PAUSED while a trial's process is still there (it checkpoints, or ignores the
    # preemption until the timeout); PAUSED when the last one has exited
    engine.store.set_experiment_state(
        experiment_id, State.STOPPING_PAUSED if runs else State.PAUSED
    )
    for t in engine.store.list_trials(experiment_id):
        if t.state == State.ACTIVE and t.id not in engine.runs:
            engine.queue.dequeue_trial(t.id, "experiment paused")
            engine.store.set_trial_state(t.id, State.PAUSED)
    if runs:
        set_stopping(exp, Stopping.PAUSE)
        for r in runs:
            if not cancel_if_queued(engine, r):
                engine.trial_jobs.preempt(r, exp)
    engine.note(
        f"experiment {experiment_id} pausing: trials checkpoint and stop"
        if runs
        else f"experiment {experiment_id} paused",
        experiment_id=experiment_id,
    )
    engine.check_idle()
    return f"experiment {experiment_id} paused"


def activate(engine: ChangesHost, experiment_id: int) -> str:
    unmanaged.refuse_control(engine, experiment_id, "activate")
    exp = engine.experiment(experiment_id)
    state = engine.store.get_experiment(experiment_id).state
    if state == State.ACTIVE and exp.stopping is None:
        return f"experiment {experiment_id} is already active"
    if state not in (State.PAUSED, State.STOPPING_PAUSED, State.ACTIVE):
        raise StateError(
            f"experiment {experiment_id} is {state.value}; only PAUSED experiments can be activated"
        )
    if exp.stopping == Stopping.PAUSE:
        set_stopping(exp, None)  # paused and activated before its trials stopped
    if state in (State.PAUSED, State.STOPPING_PAUSED):
        engine.store.set_experiment_state(experiment_id, State.ACTIVE)
    for t in engine.store.list_trials(experiment_id):
        if t.state in (State.PAUSED, State.ACTIVE) and t.id not in engine.runs:
            engine.trial_jobs.enqueue_trial(exp, t.id)
    engine.queue.schedule()
    engine.maybe_finish(exp)
    engine.check_idle()
    return f"experiment {experiment_id} activated"


def kill(engine: ChangesHost, experiment_id: int) -> str:
    unmanaged.refuse_control(engine, experiment_id, "kill")
    exp = engine.experiment(experiment_id)
    state = engine.store.get_experiment(experiment_id).state
    if state.terminal:
        return f"experiment {experiment_id} is already {state.value}"
    set_stopping(exp, Stopping.KILL)
    for t in engine.store.list_trials(experiment_id):
        if t.id not in engine.runs:
            engine.queue.dequeue_trial(t.id, "experiment killed", cancel=True)
    runs = [r for r in engine.runs.values() if r.experiment_id == experiment_id]
    if runs:
        engine.store.set_experiment_state(experiment_id, State.STOPPING_CANCELED)
    for r in runs:
        r.kill_requested = True
        engine.trial_jobs.terminate(r)
    engine.maybe_finish(exp)
    engine.check_idle()
    return f"experiment {experiment_id} killed"


def set_labels(engine: ChangesHost, experiment_id: int, add: str | None, remove: str | None) -> str:
    labels = set(engine.store.get_experiment(experiment_id).labels)
    if add:
        labels.add(add)
    if remove:
        if remove not in labels:
            raise NotFoundError(f"experiment {experiment_id} has no label '{remove}'")
        labels.discard(remove)
    engine.store.set_labels(experiment_id, labels)
    return f"experiment {experiment_id} labels: {', '.join(sorted(labels)) or '(none)'}"


def searcher_failed(engine: ChangesHost, exp: ExperimentRun, trial_id: int, why: str) -> None:
    """The searcher cannot go on (a report it needs is missing): the experiment ends in
    ERROR; running trials checkpoint and stop; what they reported stays recorded."""
    message = f"trial {trial_id}: {why}"
    engine.note(message, experiment_id=exp.id, trial_id=trial_id, level="ERROR")
    if engine.store.get_experiment(exp.id).state == State.ACTIVE:
        engine.store.set_experiment_state(exp.id, State.STOPPING_ERROR, message)
    if exp.stopping != Stopping.KILL:  # a kill outranks a failure: it still ends CANCELED
        set_stopping(exp, Stopping.ERROR)
    for t in engine.store.list_trials(exp.id):
        if t.id not in engine.runs:
            engine.queue.dequeue_trial(t.id, "experiment failed")
    for r in [r for r in engine.runs.values() if r.experiment_id == exp.id]:
        engine.trial_jobs.preempt(r, exp)
    engine.maybe_finish(exp)
