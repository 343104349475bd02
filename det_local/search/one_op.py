"""What grid and random (and single) share: each trial gets at most one operation
(`ValidateAfter(max_length)`, <=0.37) and is closed at once; max_concurrent_trials start at
first (0: as many as there are trials), and each exit starts the next trial while any remain."""

from __future__ import annotations

from typing import Any

from det_local.search.actions import Action, Close, Create, ValidateAfter
from det_local.search.base import NewTrial


class OneOperationSearch:
    def __init__(self, max_concurrent_trials: int, max_length: int | None) -> None:
        self.max_concurrent_trials = max_concurrent_trials
        self.max_length = max_length
        self.pending = 0
        self.trials: set[str] = set()

    # -- what a subclass says ------------------------------------------------------------
    def _new(self, new_trial: NewTrial) -> Create:
        """Create the next trial (and count it)."""
        raise NotImplementedError

    def _total(self) -> int:
        """How many trials the search starts at most (before InvalidHP replacements)."""
        raise NotImplementedError

    def remaining(self) -> int:
        raise NotImplementedError

    # -- shared behaviour ----------------------------------------------------------------
    def _create(self, new_trial: NewTrial) -> list[Action]:
        create = self._new(new_trial)
        self.pending += 1
        self.trials.add(create.request_id)
        actions: list[Action] = [create]
        if self.max_length is not None:
            actions.append(ValidateAfter(create.request_id, self.max_length))
        actions.append(Close(create.request_id))
        return actions

    def initial_actions(self, new_trial: NewTrial) -> list[Action]:
        n = self._total()
        if self.max_concurrent_trials > 0:
            n = min(n, self.max_concurrent_trials)
        actions: list[Action] = []
        for _ in range(n):
            actions.extend(self._create(new_trial))
        return actions

    def on_validation(
        self, request_id: str, metrics: dict[str, Any], new_trial: NewTrial
    ) -> list[Action]:
        return []

    def on_op_completed(
        self, request_id: str, length: int, metric: float, new_trial: NewTrial
    ) -> list[Action]:
        return []

    def on_trial_exited(self, request_id: str, new_trial: NewTrial) -> list[Action]:
        if request_id not in self.trials:
            return []
        self.pending -= 1
        return self._create(new_trial) if self.remaining() > 0 else []

    def rung_of(self, request_id: str) -> int | None:
        return None
