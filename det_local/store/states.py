"""Experiment and trial states (Determined's names), job states, and the transitions allowed
between them."""

from __future__ import annotations

import enum

from det_local.errors import StateError


class State(str, enum.Enum):
    ACTIVE = "ACTIVE"
    PAUSED = "PAUSED"
    # paused, but a trial's process has not exited yet (it checkpoints, or ignores the
    # preemption until the preemption timeout kills it): PAUSED once the last one is gone
    STOPPING_PAUSED = "STOPPING_PAUSED"
    STOPPING_COMPLETED = "STOPPING_COMPLETED"
    STOPPING_CANCELED = "STOPPING_CANCELED"
    STOPPING_ERROR = "STOPPING_ERROR"
    COMPLETED = "COMPLETED"
    CANCELED = "CANCELED"
    ERROR = "ERROR"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    def __str__(self) -> str:
        return self.value


TERMINAL = frozenset({State.COMPLETED, State.CANCELED, State.ERROR})

_S = State
TRANSITIONS: dict[State, frozenset[State]] = {
    _S.ACTIVE: frozenset(
        {
            _S.PAUSED,
            _S.STOPPING_PAUSED,
            _S.STOPPING_COMPLETED,
            _S.STOPPING_CANCELED,
            _S.STOPPING_ERROR,
            _S.COMPLETED,
            _S.CANCELED,
            _S.ERROR,
        }
    ),
    _S.PAUSED: frozenset({_S.ACTIVE, _S.STOPPING_CANCELED, _S.CANCELED, _S.ERROR}),
    # activated again before its trials stopped; killed; the searcher failed meanwhile
    _S.STOPPING_PAUSED: frozenset(
        {_S.PAUSED, _S.ACTIVE, _S.STOPPING_CANCELED, _S.CANCELED, _S.STOPPING_ERROR, _S.ERROR}
    ),
    _S.STOPPING_COMPLETED: frozenset(
        {_S.COMPLETED, _S.STOPPING_CANCELED, _S.STOPPING_ERROR, _S.CANCELED, _S.ERROR}
    ),
    _S.STOPPING_CANCELED: frozenset({_S.CANCELED, _S.ERROR}),
    _S.STOPPING_ERROR: frozenset({_S.ERROR}),
    _S.COMPLETED: frozenset(),
    _S.CANCELED: frozenset(),
    _S.ERROR: frozenset(),
}


def check_transition(kind: str, ident: int, old: State, new: State) -> None:
    """Raise StateError (a bug, or a request the state does not allow) for an illegal move."""
    if old == new:
        return
    if new not in TRANSITIONS[old]:
        raise StateError(f"{kind} {ident} is {old.value}; it cannot become {new.value}")


class JobState(str, enum.Enum):
    """A job in the queue (store/jobs.py keeps the values as plain strings)."""

    QUEUED = "QUEUED"  # waiting for slots
    SCHEDULED = "SCHEDULED"  # holding slots, its process started (or about to be)
    DONE = "DONE"  # its process ended (exit_code), or it never could start (message)
    CANCELED = "CANCELED"  # removed from the queue on request before it started

    def __str__(self) -> str:
        return self.value


JOB_ENDED = frozenset({JobState.DONE, JobState.CANCELED})

_J = JobState
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _J.QUEUED: frozenset({_J.SCHEDULED, _J.DONE, _J.CANCELED}),
    # preempted or restarted: queued again; or ended
    _J.SCHEDULED: frozenset({_J.QUEUED, _J.DONE}),
    # a trial's job is queued again: activated after a pause, promoted, a test-mode restore run
    _J.DONE: frozenset({_J.QUEUED}),
    _J.CANCELED: frozenset(),
}


def job_sources(new: JobState) -> frozenset[JobState]:
    """The states a job may be in to become ``new`` (``new`` itself included: a repeated
    write of the same state is no transition)."""
    return frozenset({old for old, targets in JOB_TRANSITIONS.items() if new in targets} | {new})


def check_job_transition(job_id: int, old: str, new: JobState) -> None:
    if old == new.value:
        return
    try:
        allowed = JOB_TRANSITIONS[JobState(old)]
    except ValueError:
        allowed = frozenset()
    if new not in allowed:
        raise StateError(f"job {job_id} is {old}; it cannot become {new.value}")
