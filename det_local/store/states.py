"""Every state det-local records, and the moves allowed between them (DESIGN rule 3).

* :class:`State`: experiments and trials (Determined's names);
* :class:`JobState`: the queue's jobs;
* :class:`CheckpointState`: recorded checkpoints;
* :class:`Stopping`: why the engine is stopping an experiment's running trials (held in
  memory, never stored; ``None`` when it is not stopping them).

Each is a ``str`` enum whose values are the strings stored in the database and printed by
``--json``: a member equals its string (``JobState.QUEUED == "QUEUED"``). Each has a table of
the moves allowed from every state. A move the table lacks is a bug (or a request the state
does not allow) and raises :class:`~det_local.errors.StateError`, naming both states; staying
in a state is always allowed.

The queue's priorities (:data:`MIN_PRIORITY`..:data:`MAX_PRIORITY`, :data:`DEFAULT_PRIORITY`)
live with the scheduling policy, in ``det_local/sched/queue/policy.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

from det_local.errors import StateError

_E = TypeVar("_E", bound=enum.Enum)


def _check(table: Mapping[_E, frozenset[_E]], kind: str, ident: object, old: _E, new: _E) -> None:
    if old != new and new not in table[old]:
        raise StateError(f"{kind} {ident} is {old.value}; it cannot become {new.value}")


def _sources(table: Mapping[_E, frozenset[_E]]) -> dict[_E, frozenset[_E]]:
    """For each state, the states it may be reached from (itself included)."""
    return {
        new: frozenset(old for old in table if old == new or new in table[old]) for new in table
    }


# -- experiments and trials -------------------------------------------------------------------
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
    # ended for good, but for `experiment continue` (a single-trial experiment, and its trial,
    # trained further from the latest checkpoint: sched/daytwo/cont.py)
    _S.COMPLETED: frozenset({_S.ACTIVE}),
    _S.CANCELED: frozenset({_S.ACTIVE}),
    _S.ERROR: frozenset({_S.ACTIVE}),
}


def check_transition(kind: str, ident: int, old: State, new: State) -> None:
    """Raise StateError (a bug, or a request the state does not allow) for an illegal move of
    an experiment or a trial (``kind`` names which)."""
    _check(TRANSITIONS, kind, ident, old, new)


# -- jobs ---------------------------------------------------------------------------------------
class JobState(str, enum.Enum):
    """A job waits for slots (QUEUED), holds them with its process running (SCHEDULED), or
    has ended (DONE; CANCELED: removed from the queue before it ever ran). A trial's job
    ended by a pause is queued again when its experiment is activated (DONE -> QUEUED)."""

    QUEUED = "QUEUED"
    RESERVED = "RESERVED"  # a share of a gang across machines: slots held, nothing spawned yet
    SCHEDULED = "SCHEDULED"
    DONE = "DONE"
    CANCELED = "CANCELED"

    @property
    def active(self) -> bool:
        """Queued or running: in the scheduler's view."""
        return self in JOB_ACTIVE

    def __str__(self) -> str:
        return self.value


JOB_ACTIVE = frozenset({JobState.QUEUED, JobState.RESERVED, JobState.SCHEDULED})


class JobKind(str, enum.Enum):
    """What a job runs: a trial's run, a command (or a shell, notebook or TensorBoard: the
    interactive tasks), or a MEMBER: this node's share of a trial owned by another machine."""

    TRIAL = "TRIAL"
    COMMAND = "COMMAND"
    SHELL = "SHELL"
    NOTEBOOK = "NOTEBOOK"
    TENSORBOARD = "TENSORBOARD"
    MEMBER = "MEMBER"

    def __str__(self) -> str:
        return self.value


# the kinds a command runs as (`sched/run/commands.py`)
TASK_KINDS = (JobKind.COMMAND, JobKind.SHELL, JobKind.NOTEBOOK, JobKind.TENSORBOARD)

_J = JobState
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # started; ended while waiting (its trial stopped, a command removed); canceled while queued
    _J.QUEUED: frozenset({_J.SCHEDULED, _J.RESERVED, _J.DONE, _J.CANCELED}),
    # a gang's share: committed (its ranks spawn); released (wounded, lease over); aborted
    _J.RESERVED: frozenset({_J.SCHEDULED, _J.QUEUED, _J.DONE}),
    # preempted or never spawned (back in the queue, in its place); its process ended
    _J.SCHEDULED: frozenset({_J.QUEUED, _J.DONE}),
    # a trial's job queued again (its experiment activated, its trial resumed)
    _J.DONE: frozenset({_J.QUEUED}),
    _J.CANCELED: frozenset(),
}
# the states each state may be reached from (itself included): a state change's WHERE clause
JOB_SOURCES: dict[JobState, frozenset[JobState]] = _sources(JOB_TRANSITIONS)


def check_job_transition(job_id: int, old: JobState, new: JobState) -> None:
    _check(JOB_TRANSITIONS, "job", job_id, old, new)


# -- checkpoints --------------------------------------------------------------------------------
class CheckpointState(str, enum.Enum):
    """A checkpoint is recorded COMPLETED (once its files are written); checkpoint GC or its
    trial deletes its files (DELETED: the record and its metrics stay). PARTIALLY_DELETED is
    Determined's name for a checkpoint some of whose files were deleted; det-local never
    deletes part of a checkpoint, but such a checkpoint can still be downloaded."""

    COMPLETED = "COMPLETED"
    PARTIALLY_DELETED = "PARTIALLY_DELETED"
    DELETED = "DELETED"

    def __str__(self) -> str:
        return self.value


_C = CheckpointState
CHECKPOINT_TRANSITIONS: dict[CheckpointState, frozenset[CheckpointState]] = {
    _C.COMPLETED: frozenset({_C.PARTIALLY_DELETED, _C.DELETED}),
    _C.PARTIALLY_DELETED: frozenset({_C.DELETED}),
    _C.DELETED: frozenset(),
}
CHECKPOINT_INITIAL = frozenset({CheckpointState.COMPLETED})  # the state a record is added in
CHECKPOINT_DOWNLOADABLE = (CheckpointState.COMPLETED, CheckpointState.PARTIALLY_DELETED)


def check_checkpoint_transition(uuid: str, old: CheckpointState, new: CheckpointState) -> None:
    _check(CHECKPOINT_TRANSITIONS, "checkpoint", uuid, old, new)


# -- why the engine stops an experiment's trials ------------------------------------------------
class Stopping(str, enum.Enum):
    """Why an experiment's running trials are being stopped (``None``: they are not)."""

    PAUSE = "pause"  # paused: trials checkpoint and stop; the experiment resumes when activated
    KILL = "kill"  # killed: trials are terminated; the experiment ends CANCELED
    ERROR = "error"  # the searcher cannot go on: trials checkpoint and stop; it ends in ERROR

    def __str__(self) -> str:
        return self.value


_P = Stopping
# keyed by the reason now (None: not stopping); None as a target: the trials have stopped, or
# a pause was undone by an activation
STOPPING_TRANSITIONS: dict[Stopping | None, frozenset[Stopping | None]] = {
    None: frozenset({_P.PAUSE, _P.KILL, _P.ERROR}),
    _P.PAUSE: frozenset({None, _P.KILL, _P.ERROR}),  # a kill, or a searcher failure, outranks
    _P.ERROR: frozenset({None, _P.KILL}),  # a kill outranks a failure
    _P.KILL: frozenset({None}),  # nothing outranks a kill
}


def check_stopping(experiment_id: int, old: Stopping | None, new: Stopping | None) -> None:
    """Raise StateError for an illegal change of an experiment's stopping reason."""
    if old != new and new not in STOPPING_TRANSITIONS[old]:
        raise StateError(
            f"experiment {experiment_id} is stopping with reason {old or 'none'}; "
            f"it cannot change to {new or 'none'}"
        )
