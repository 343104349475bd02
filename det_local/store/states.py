"""Experiment and trial states (Determined's names) and the transitions allowed between them."""

from __future__ import annotations

import enum

from det_local.errors import StateError


class State(str, enum.Enum):
    ACTIVE = "ACTIVE"
    PAUSED = "PAUSED"
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
            _S.STOPPING_COMPLETED,
            _S.STOPPING_CANCELED,
            _S.STOPPING_ERROR,
            _S.COMPLETED,
            _S.CANCELED,
            _S.ERROR,
        }
    ),
    _S.PAUSED: frozenset({_S.ACTIVE, _S.STOPPING_CANCELED, _S.CANCELED, _S.ERROR}),
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
