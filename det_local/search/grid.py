"""Grid search: one trial per grid point (``hparams_grid``), taken from the end of the grid,
max_concurrent_trials at a time (0: all at once). A trial's exit, whatever its reason, starts
the next point; an InvalidHP point is not retried or replaced."""

from __future__ import annotations

from typing import Any

from det_local.config.hparams import Hyperparameter
from det_local.search.actions import Action, Create, SearchState
from det_local.search.base import NewTrial
from det_local.search.hparams_grid import grid_axes, grid_point, grid_size
from det_local.search.one_op import OneOperationSearch


class GridSearch(OneOperationSearch):
    def __init__(
        self,
        hyperparameters: dict[str, Hyperparameter],
        max_concurrent_trials: int = 16,
        max_length: int | None = None,
    ) -> None:
        super().__init__(max_concurrent_trials, max_length)
        self.axes = grid_axes(hyperparameters)
        self.size = grid_size(self.axes)
        self.taken = 0  # points created so far, counted from the end of the grid

    def remaining(self) -> int:
        return self.size - self.taken

    def _total(self) -> int:
        return self.size

    def _new(self, new_trial: NewTrial) -> Create:
        point = grid_point(self.axes, self.size - 1 - self.taken)
        self.taken += 1
        return new_trial(point)

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
