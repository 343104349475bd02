"""Grid search: one trial per grid point (``hparams_grid``), taken from the end of the grid,
max_concurrent_trials at a time (0: all at once). A trial's exit, whatever its reason, starts
the next point; an InvalidHP point is not retried or replaced."""

from __future__ import annotations

from typing import Any

from det_local.config.hparams import Hyperparameter
from det_local.search.actions import Action, Close, SearchState, ValidateAfter
from det_local.search.base import NewTrial
from det_local.search.hparams_grid import grid_axes, grid_point, grid_size


class GridSearch:
    def __init__(
        self,
        hyperparameters: dict[str, Hyperparameter],
        max_concurrent_trials: int = 16,
        max_length: int | None = None,
    ) -> None:
        self.axes = grid_axes(hyperparameters)
        self.size = grid_size(self.axes)
        self.max_concurrent_trials = max_concurrent_trials
        self.max_length = max_length
        self.taken = 0  # points created so far, counted from the end of the grid
        self.pending = 0
        self.trials: set[str] = set()

    def remaining(self) -> int:
        return self.size - self.taken

    def _create(self, new_trial: NewTrial) -> list[Action]:
        point = grid_point(self.axes, self.size - 1 - self.taken)
        self.taken += 1
        self.pending += 1
        create = new_trial(point)
        self.trials.add(create.request_id)
        actions: list[Action] = [create]
        if self.max_length is not None:
            actions.append(ValidateAfter(create.request_id, self.max_length))
        actions.append(Close(create.request_id))
        return actions

    def initial_actions(self, new_trial: NewTrial) -> list[Action]:
        n = self.size
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

    def on_trial_exited_early(
        self, request_id: str, reason: str, new_trial: NewTrial
    ) -> list[Action]:
        return self.on_trial_exited(request_id, new_trial)

    def progress(self, state: SearchState) -> float:
        """Ended trials (InvalidHP ones included: each is one grid point) count whole, live
        ones their reported fraction, out of the grid size."""
        done = len(state.completed) + len(state.failed) + len(state.invalid)
        running = sum(state.trial_progress.values())
        return min((done + running) / max(self.size, 1), 1.0)

    def rung_of(self, request_id: str) -> int | None:
        return None

    def snapshot(self) -> dict[str, Any]:
        return {
            "kind": "grid",
            "grid_size": self.size,
            "taken": self.taken,
            "pending_trials": self.pending,
            "trials": sorted(self.trials),
        }

    def restore(self, data: dict[str, Any]) -> None:
        self.taken = int(data["taken"])
        self.pending = int(data["pending_trials"])
        self.trials = set(data["trials"])
