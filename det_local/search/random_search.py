"""Random search (and single, which is random with one trial): trials with sampled
hyperparameters, max_concurrent_trials at a time (0: all at once), each exit replaced by a new
trial until max_trials were created. An InvalidHP trial does not count towards max_trials in a
random search (it is replaced); in single it is not.

With max_length (<=0.37) each trial gets one ``ValidateAfter(max_length)``; every trial is
closed at once (it has no other operation)."""

from __future__ import annotations

from typing import Any

from det_local.search.actions import Action, Create, SearchState
from det_local.search.base import INVALID_HP, NewTrial
from det_local.search.one_op import OneOperationSearch


class RandomSearch(OneOperationSearch):
    kind = "random"

    def __init__(
        self, max_trials: int, max_concurrent_trials: int = 16, max_length: int | None = None
    ) -> None:
        super().__init__(max_concurrent_trials, max_length)
        self.max_trials = max_trials
        self.created = 0

    def remaining(self) -> int:
        return self.max_trials - self.created

    def _total(self) -> int:
        return self.max_trials

    def _new(self, new_trial: NewTrial) -> Create:
        self.created += 1
        return new_trial()

    def on_trial_exited_early(
        self, request_id: str, reason: str, new_trial: NewTrial
    ) -> list[Action]:
        if request_id not in self.trials:
            return []
        if reason == INVALID_HP and self.kind == "random":
            self.created -= 1  # its replacement does not count
        return self.on_trial_exited(request_id, new_trial)

    def progress(self, state: SearchState) -> float:
        """Ended trials (InvalidHP ones excepted) count whole, live ones their reported
        fraction, out of max_trials."""
        done = len(state.completed) + len(state.failed)
        running = sum(state.trial_progress.values())
        return min((done + running) / self.max_trials, 1.0)

    def snapshot(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "max_length": self.max_length,
            "created_trials": self.created,
            "pending_trials": self.pending,
            "trials": sorted(self.trials),
        }

    def restore(self, data: dict[str, Any]) -> None:
        if "created_trials" not in data:  # a snapshot of the earlier single searcher
            self.created = self.max_trials
            self.pending = 1
            self.trials = set()
            return
        self.created = int(data["created_trials"])
        self.pending = int(data["pending_trials"])
        self.trials = set(data["trials"])


class SingleSearch(RandomSearch):
    """One trial (Determined implements single as random with max_trials 1)."""

    kind = "single"

    def __init__(self, max_length: int | None = None) -> None:
        super().__init__(max_trials=1, max_concurrent_trials=1, max_length=max_length)
